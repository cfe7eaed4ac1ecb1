"""`threefold.prepare`: any `nn.Module` trained under threefold's strategies, from your own loop.

    engine = threefold.prepare(model, loss_fn, config, units=[nn.TransformerEncoderLayer])
    for batch in my_batches:                 # this rank's share: (inputs, targets)
        record = engine.train_step(batch)    # forward, loss, backward, sync, clip, optimizer step
    engine.save("ckpt")                      # a universal threefold checkpoint (ckpt/step-N)

The contract (docs/engine.md):

    prepare(model, loss_fn, config=None, *, units=None, remat=None, buffers="synced", plan=None,
            lora=None) -> Engine
        model      any nn.Module, with its values (rank 0's are broadcast to every dp rank)
        loss_fn    loss_fn(outputs, targets) -> the mean loss of the batch (nn.CrossEntropyLoss() etc.)
        config     a threefold Config, a list of "KEY=VALUE" strings, or None (defaults); its
                   parallel / precision / remat / compress / train sections apply as on the CLI
                   (train.steps sets the cosine schedule's length, train.microbatches the accumulation)
        units      ZeRO-3 units and remat regions: module classes or submodule names
        remat      the checkpointed regions when remat.policy=full, if not the units
        buffers    "synced" (floating buffers averaged over dp every step) or "local"
        plan       tensor parallelism (parallel.tp > 1): {submodule pattern: "colwise" | "rowwise"}
                   ("*" matches one name: {"encoder.layers.*.linear1": "colwise", ...}) or a TensorPlan
        lora       a peft LoraConfig: peft.get_peft_model(model, lora) trains its adapters, the base frozen
    Engine.train_step((inputs, targets)) -> dict   step, loss (mean over dp), grad_norm, lr, loss_scale,
                                                   skipped, step_time_s, comm ({axis: {op: bytes}})
    Engine.eval_step((inputs, targets)) -> float   the mean loss over dp, in eval mode, no gradients
    Engine.save(dir) / Engine.load(dir)            checkpoints under dir/step-N (load: the newest, or a step dir);
                                                   save returns None, saving nothing, after a step whose loss
                                                   or grad_norm is not finite (one line names the rank)
    Engine.module                                  the model (ZeRO-3: parameters are this rank's flat shards)
    Engine.batch_shard                             (index, count): ranks of one index take the same batch

The world is dp x tp (tp = parallel.tp, dp the rest); the tp ranks of one dp coordinate must be given the
same batch (`batch_shard`). `inputs` is a tensor or a tuple of tensors (the module's positional arguments; floating-point ones are
cast to precision.compute); every tensor of a batch is split along dimension 0 into train.microbatches
micro-batches. The gradient is that of
the mean of the dp ranks' mean losses (DDP's convention: exact for equal batches).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .checkpoint import Checkpointer, TrainingState
from .checkpoint.verify import find_checkpoint_dir
from .comm import Comm
from .checkpoint.format import layout_record, step_dir_name
from .config import Config, load_config, with_overrides
from .errors import ConfigError
from .mesh import BATCH, Layout, Mesh, init_distributed, pick_device
from .observe.nonfinite import PoisonedSaves, poisoned
from .observe.stats import gather_world
from .parallel.module import ModuleParallel, Plan, Units, parallelize_module, refuse_unplanned
from .train.step import TrainStep

__all__ = ["Engine", "prepare"]


def _split(x, parts: int) -> list:
    """`x` (a tensor or nested tuple/list/dict of them) cut into `parts` along dimension 0."""
    if isinstance(x, torch.Tensor):
        if x.shape[0] % parts:
            raise ConfigError("train.microbatches", f"{parts} does not divide the batch of {x.shape[0]}")
        return list(x.chunk(parts))
    if isinstance(x, (tuple, list)):
        cols = [_split(item, parts) for item in x]
        return [type(x)(col[i] for col in cols) for i in range(parts)]
    if isinstance(x, dict):
        cols = {k: _split(v, parts) for k, v in x.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    return [x] * parts


def _to(x, device: torch.device, dtype: torch.dtype | None = None):
    """`x` on `device`; its floating-point tensors in `dtype` when given (the inputs, in the compute dtype)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, dtype) if dtype is not None and x.is_floating_point() else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(item, device, dtype) for item in x)
    if isinstance(x, dict):
        return {k: _to(v, device, dtype) for k, v in x.items()}
    return x


def _call(module: nn.Module, inputs):
    return module(*inputs) if isinstance(inputs, (tuple, list)) else module(inputs)


class Engine:
    """A prepared module: `train_step`, `eval_step`, `save`, `load` (see the module docstring)."""

    def __init__(self, parallel: ModuleParallel, loss_fn: Callable, cfg: Config, mesh: Mesh, comm: Comm):
        self.parallel, self.loss_fn, self.cfg, self.mesh, self.comm = parallel, loss_fn, cfg, mesh, comm
        self.module = parallel.module
        self.optimizer = parallel.make_optimizer(cfg.train)
        self.step_fn = TrainStep(parallel, self.optimizer, comm, cfg.train)
        self.step = 0
        comm.traffic.take_window()  # the start's broadcast belongs to no step
        self._last: dict | None = None  # the last step's record, and this rank's own loss of it (`save`)
        self._local_loss: torch.Tensor | None = None
        self._saved: Path | None = None  # the newest checkpoint this engine wrote or loaded
        self.poisoned = PoisonedSaves(mesh.global_rank == 0)  # no save of a non-finite step (observe/nonfinite.py)

    @property
    def batch_shard(self) -> tuple[int, int]:
        """(this rank's index, the count) along the axes that split the samples: feed ranks of one index
        the same batch (the tp ranks of a dp coordinate), and different indices different batches."""
        axis = self.mesh.axis_over(self.mesh.axes_where(BATCH))
        return self.mesh.rank(axis), self.mesh.size(axis)

    def _micro_batches(self, batch) -> list:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("a batch is a pair (inputs, targets)")
        inputs, targets = batch
        inputs = _to(inputs, self.mesh.device, self.parallel.precision.compute_dtype)
        return _split((inputs, _to(targets, self.mesh.device)), self.cfg.train.microbatches)

    def train_step(self, batch) -> dict:
        """One optimizer step on this rank's `batch`; the step's figures, read back (one host sync)."""
        start = time.perf_counter()
        self.module.train()
        micro = self._micro_batches(batch)
        self.step += 1
        batch_axis = self.mesh.axis_over(self.mesh.axes_where(BATCH))  # the axes that split the samples
        result = self.step_fn(self.step, micro, self.mesh.size(batch_axis) * len(micro))
        loss = result.loss_sum.reshape(1).clone()
        self.comm.all_reduce(loss, batch_axis, tag="metrics")
        grad_norm, skipped, scale, loss_total = result.read(loss[0])
        self._local_loss = result.loss_sum  # read only when a save is refused: which rank's loss went non-finite
        self._last = {"step": self.step, "loss": loss_total / (self.mesh.size(batch_axis) * len(micro)),
                      "grad_norm": grad_norm, "lr": result.lr, "loss_scale": scale, "skipped": bool(skipped),
                      "step_time_s": time.perf_counter() - start, "comm": self.comm.traffic.take_window()}
        return self._last

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """The mean loss of `batch` over dp, in eval mode (batch norm uses its running statistics)."""
        self.parallel.settle()
        was = self.module.training
        self.module.eval()
        try:
            total = torch.zeros(1, device=self.mesh.device)
            micro = self._micro_batches(batch)
            for mb in micro:
                total += self.parallel.loss_of(self.module, mb).float()
            batch_axis = self.mesh.axis_over(self.mesh.axes_where(BATCH))
            self.comm.all_reduce(total, batch_axis, tag="metrics")
        finally:
            self.module.train(was)
        return total.item() / (self.mesh.size(batch_axis) * len(micro))

    # ------------------------------------------------------------ checkpoints

    def _state(self) -> TrainingState:
        self.parallel.settle()  # ZeRO-1/2: the last step's parameter all-gathers are complete
        named, placements = self.parallel.checkpoint_tensors()
        return TrainingState(named, placements, self.optimizer, dict(self.parallel.stateful),
                             rank_state=self.parallel.rank_state, rank=self.mesh.global_rank,
                             layout=self._layout())

    def _layout(self) -> dict:
        return layout_record(self.mesh.layout, self.cfg.parallel.zero)

    def save(self, directory: str | Path) -> Path | None:
        """Save parameters, buffers, optimizer, RNG and the step as `directory/step-N`; returns it.

        A step whose loss or gradient norm is not finite is not saved (the trainer's rule,
        observe/nonfinite.py): rank 0 prints one line naming the step, the rank(s) whose own loss
        went non-finite and the newest checkpoint, which stays the newest; returns None."""
        if self._last is not None and poisoned(self._last) is not None:  # the same verdict on every rank
            bad = gather_world(self.comm, (~torch.isfinite(self._local_loss.detach())).to(torch.uint8).reshape(1),
                               tag="nonfinite")  # only on this path: which ranks' own losses
            ranks = [r for r, flag in enumerate(bad.flatten().tolist()) if flag]
            newest = str(self._saved) if self._saved is not None else "none (nothing saved yet)"
            if self.poisoned.refuses({**self._last, "nonfinite": {"ranks": ranks}}, newest):
                return None
        ckpt = Checkpointer(Path(directory), self.mesh, self.comm, keep=0)
        meta = {"layout": self._layout(), "data": {"step": self.step}, "config": self.cfg.to_dict()}
        ckpt.save(self.step, self._state(), meta)
        ckpt.close()
        self._saved = Path(directory) / step_dir_name(self.step)
        return self._saved

    def load(self, directory: str | Path) -> int:
        """Restore from `directory` (its newest checkpoint, or a step directory), any dp / ZeRO layout;
        returns the step it was written at (the next train_step is that step + 1)."""
        ckpt = Checkpointer(Path(directory).parent, self.mesh, self.comm, keep=0)
        found = find_checkpoint_dir(Path(directory))
        manifest = ckpt.load(found, self._state())
        self.step, self._saved, self._last = manifest.step, found, None
        self.optimizer.after_load(manifest.step, any(n.endswith("/master") for n in manifest.tensors))
        return self.step


# What the trainer's own loop reads and `threefold.prepare` never does: your loop saves, evaluates, logs and
# stops, so each of these set away from its default would change nothing (refused in one line)
TRAINER_ONLY = (
    "debug.nan_check", "debug.stats", "debug.straggler_ratio", "debug.fingerprint_every", "debug.replica_check_every",
    "debug.trace", "debug.dump_params", "debug.hang_timeout_s", "debug.hang_grace_s",
    "run.trackers", "run.tensorboard", "run.out",
    "checkpoint.save_every", "checkpoint.async_save", "checkpoint.keep", "checkpoint.resume", "checkpoint.init_from",
    "checkpoint.peer_copy", "train.eval_every", "fault.rank",
)


def refuse_trainer_only(cfg: Config) -> None:
    """One ConfigError for the first of `TRAINER_ONLY` set away from its default."""
    defaults = Config()
    for key in TRAINER_ONLY:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != getattr(getattr(defaults, section), name):
            raise ConfigError(key, "is read by threefold train's own loop, not by threefold.prepare (your loop "
                              "saves, evaluates, logs and watches; docs/engine.md); drop it")


def prepare(model: nn.Module, loss_fn: Callable, config: Config | Sequence[str] | None = None, *,
            units: Units = None, remat: Units = None, buffers: str = "synced", plan: Plan = None,
            lora=None) -> Engine:
    """`model` under `config`'s tensor (by `plan`) and data parallelism / ZeRO stage, precision, remat,
    compile and optimizer; with `lora` (a peft LoraConfig), its peft LoRA model."""
    cfg = config if isinstance(config, Config) else load_config(None, list(config or ()))
    device = pick_device(cfg.run.device)
    init_distributed(device, cfg.run.collective_timeout_s)
    world = torch.distributed.get_world_size()
    cfg = cfg.for_device(device.type)
    refuse_unplanned(cfg, plan is not None)  # tp needs a plan, pp/ep/cp a model family: one line
    refuse_trainer_only(cfg)
    tp = cfg.parallel.tp
    if world % tp:
        raise ConfigError("parallel.tp", f"{tp} does not divide the {world} processes")
    if cfg.parallel.dp not in (0, world // tp):
        raise ConfigError("parallel.dp", f"{cfg.parallel.dp} x tp={tp} does not match the {world} processes; "
                          "use 0 (auto)")
    dp = world // tp
    # the batch is the caller's: global_batch only has to be consistent for the checks
    cfg = with_overrides(cfg, parallel={"dp": dp},
                         train={"global_batch": dp * cfg.train.microbatches}).validate(world)
    if lora is not None:
        if tp > 1:
            raise ConfigError("lora", "peft's adapter layers are not split by a tensor plan; use parallel.tp=1 "
                              "(the CLI's model.lora_rank splits adapters with their base layers under tp)")
        model = _with_lora(model, lora)
    mesh = Mesh(Layout(dp=dp, tp=tp), device)
    comm = Comm(mesh, history=cfg.debug.history)

    def loss_of(module: nn.Module, mb) -> torch.Tensor:
        inputs, targets = mb
        return loss_fn(_call(module, inputs), targets)

    parallel = parallelize_module(model, mesh, comm, cfg, loss_of, units, remat, buffers, plan)
    return Engine(parallel, loss_fn, cfg, mesh, comm)


def _with_lora(model: nn.Module, lora) -> nn.Module:
    """peft's LoRA model of `model` (its base weights frozen, the adapters trainable)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora", "needs peft: pip install 'threefold[lora]'") from None
    if not isinstance(lora, LoraConfig):
        raise ConfigError("lora", f"give a peft LoraConfig, not {type(lora).__name__}")
    return get_peft_model(model, lora)
