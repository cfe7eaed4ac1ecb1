"""The optimizer over the pieces of parameters a rank owns: fp32 masters, AdamW or SGD, offload.

Shared machinery of plain data parallelism and ZeRO 1-3. A *piece* is the part of one local
parameter whose update this rank computes: the whole parameter without ZeRO, a contiguous
range of its flattening under ZeRO 1-3. For every piece the optimizer keeps

    master      fp32 copy of the piece (the model holds it in the compute dtype); when the model
                itself is fp32 and nothing is offloaded the master *is* the model's storage
    exp_avg, exp_avg_sq   AdamW moments, fp32            (train.optimizer=adamw)
    momentum_buffer       SGD momentum, fp32             (train.optimizer=sgd, train.momentum > 0)

and runs the torch optimizer `train.optimizer` names (AdamW or SGD) on the masters, multi-tensor:
fused on CUDA (one kernel over all pieces; the step counts stay on the device and the skip
decision after an overflow is a device flag, `step(found_inf)`, the `found_inf` of torch's fused
kernels as CUDA loss scalers use it: a step never reads a value back to the host), `foreach`
elsewhere (its bits are the single-tensor loop's; torch's CPU fused kernels round a piece's
vector tail differently, so they would break the guarantee below; on CPU reading the skip flag
costs nothing, there is no device queue to drain). Both are elementwise, so any partition of
the parameters into pieces gives the same bits as the unsharded optimizer
(tests/unit/test_optimizer.py, tests/distributed/test_zero.py). The states are allocated up
front (torch creates them on the first step), so they are counted by memory reports and
checkpointable from step 0.

Offload (`parallel.offload=optimizer`): masters and states live in a separate host pool
(pinned CPU memory next to an accelerator, a separate CPU copy on a CPU-only machine: the same
code path), gradients are copied there, the optimizer runs there, and the updated pieces are copied
back into the model, so accelerator memory holds only what compute needs.

Compression may change what the optimizer does: 1-bit Adam swaps `inner` for its own AdamW
(comm/compression/onebit_adam.py), and DGC's momentum correction applies the momentum before
the exchange, so `ParallelModel.make_optimizer` then builds SGD without momentum.

Checkpoints: `named_state()` returns every state tensor with a `Placement` naming the global
tensor it is a part of (`optimizer.<kind>.<parameter>`, shaped like the parameter), so sharded
optimizer states save and reload at any layout through the placement contract alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..optim import adamw, sgd
from ..optim.exchange import MatrixExchange
from ..optim.muon import hidden_matrix
from ..optim.registry import entry
from ..sharding import Placement


@dataclass
class Piece:
    name: str  # local parameter name
    placement: Placement  # the elements of the global parameter this piece holds
    model: torch.Tensor  # 1-D view of the piece inside the model's storage (compute dtype)
    grad: Callable[[], torch.Tensor]  # the summed gradient of the piece (1-D, same length), after finish()
    decay: bool  # weight decay applies (matrices and embeddings, not biases and norm gains)
    start: int = 0  # range of the local parameter's flattening: [start, start + numel)
    initial: torch.Tensor | None = None  # fp32 values of the piece from before the cast to the compute dtype,
    # when they are known only for the piece (ZeRO-3's unit-by-unit build: materialise.Deferred)


def fused_on(device: torch.device) -> bool:
    """Fused AdamW / SGD where the masters are on CUDA (foreach would read every step count on the
    host and could not skip a step without reading the overflow flag)."""
    return device.type == "cuda"


def make_inner(groups: list[dict], cfg: TrainConfig, device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """The torch optimizer `cfg.optimizer` over parameter groups (optim/registry.py), multi-tensor (module
    docstring): elementwise kernels, so the same bits whatever the tensors' grouping."""
    return entry(cfg.optimizer).make(groups, cfg, fused_on(device), None).optimizer


def state_kinds(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the per-tensor states of a torch AdamW / SGD (or 1-bit Adam), shaped like the tensor."""
    if isinstance(optimizer, torch.optim.SGD):
        return sgd.KINDS if optimizer.defaults["momentum"] else ()
    return adamw.KINDS


def fp32_grads(grads: list[torch.Tensor], own: list[bool], host: torch.device,
               inv_scale: float | torch.Tensor) -> list[torch.Tensor]:
    """fp32 unscaled gradients on `host`: `grads[i]` itself where `own[i]`, else a view of one flat buffer
    filled by one multi-tensor copy (with the cast) and one multiply for all, not kernels per tensor."""
    if isinstance(inv_scale, torch.Tensor):
        inv_scale = inv_scale.to(host)  # a host read only with offload
    out = list(grads)
    copied = [i for i, o in enumerate(own) if not o]
    if copied:
        sizes = [grads[i].numel() for i in copied]
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=host)
        views = flat.split(sizes)
        torch._foreach_copy_(views, [grads[i] for i in copied])
        if isinstance(inv_scale, torch.Tensor) or inv_scale != 1.0:
            flat.mul_(inv_scale)
        for i, view in zip(copied, views):
            out[i] = view
    return out


class ShardedOptimizer:
    """AdamW or SGD (`train.optimizer`) over this rank's pieces with fp32 masters, optionally in a host pool.

    Used by the training step as: `prepare_grads(1 / loss_scale)` -> norm over `masters` ->
    clip -> `step(found_inf)` (a 0-dim device flag: the update is skipped where it is set).
    Exposes `param_groups` like a torch optimizer, so learning-rate schedules apply unchanged.
    """

    scratch_nbytes = 0  # bytes kept in scratch files (parallel.offload=nvme's optimizer: parallel/nvme.py)

    def __init__(self, pieces: list[Piece], cfg: TrainConfig, fp32_init: dict[str, torch.Tensor] | None = None,
                 offload: bool = False, after_step: Callable[[], None] | None = None, comm=None):
        self.pieces = pieces
        self._pre_hooks: list[Callable[[], None]] = []
        self.offload = offload
        self.after_step = after_step
        fp32_init = fp32_init or {}
        device = pieces[0].model.device if pieces else torch.device("cpu")
        self.host = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"
        self.masters: list[nn.Parameter] = []
        self.aliased: list[bool] = []  # master shares the model's storage (fp32, no offload)
        for piece in pieces:
            alias = piece.model.dtype == torch.float32 and not offload
            if alias:
                master = nn.Parameter(piece.model.detach(), requires_grad=False)
            else:
                values = self._initial_values(piece, fp32_init.get(piece.name))
                buf = torch.empty(values.shape, dtype=torch.float32, device=self.host, pin_memory=pin)
                master = nn.Parameter(buf.copy_(values), requires_grad=False)
            self.masters.append(master)
            self.aliased.append(alias)
        self.placements = [p.placement for p in pieces]
        made = self._make(cfg, comm)
        self.inner, self.kinds = made.optimizer, made.kinds
        self.steps = 0  # optimizer steps taken (skipped steps excluded)
        # fused AdamW keeps its per-tensor step counts on the device (no host read per step)
        step_device = self.host if self.inner.defaults.get("fused") else torch.device("cpu")
        for master in self.masters:  # allocate the states now: counted and checkpointable from step 0
            kinds = self.kinds(master)
            state = {kind: torch.zeros_like(master) for kind in kinds}
            if "exp_avg" in kinds:
                state = {"step": torch.tensor(0.0, device=step_device), **state}  # Adam's per-tensor step counts
            self.inner.state[master] = state

    def _make(self, cfg: TrainConfig, comm):
        """The registry's optimizer over the masters: decayed and not, and for an optimizer that needs
        whole matrices the hidden matrices apart, with the exchange that assembles them (optim/exchange.py)."""
        e, pieces = entry(cfg.optimizer), self.pieces
        matrix = [e.whole_matrices and hidden_matrix(p.placement.name, p.placement.global_shape) for p in pieces]
        groups = [{"params": [m for m, p, x in zip(self.masters, pieces, matrix) if x], "weight_decay": cfg.weight_decay,
                   "matrix": True},
                  {"params": [m for m, p, x in zip(self.masters, pieces, matrix) if p.decay and not x],
                   "weight_decay": cfg.weight_decay},
                  {"params": [m for m, p, x in zip(self.masters, pieces, matrix) if not p.decay and not x],
                   "weight_decay": 0.0}]
        if not e.whole_matrices:
            groups = [g for g in groups[1:] if g["params"]]
            # a placeholder keeps a rank that owns no piece (possible under ZeRO) a valid optimizer
            return e.make(groups or [{"params": [torch.zeros(0)], "weight_decay": 0.0}], cfg, fused_on(self.host), None)
        if comm is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError("train.optimizer", f"{cfg.optimizer} on more than one process needs the run's Comm "
                              "to exchange whole matrices, and none was given; use one process or adamw")
        axis = comm.mesh.replica_axis if comm is not None else "dp"
        exchange = MatrixExchange([p.placement for p, x in zip(pieces, matrix) if x], comm, axis)
        return e.make([g for g in groups if g["params"] or g.get("matrix")], cfg, fused_on(self.host), exchange)

    @staticmethod
    def _initial_values(piece: Piece, fp32_param: torch.Tensor | None) -> torch.Tensor:
        """fp32 values of the piece: from before the cast to the compute dtype when known."""
        if piece.initial is not None:
            return piece.initial.to(piece.model.device)
        if fp32_param is None:
            return piece.model.detach().float()
        flat = fp32_param.reshape(-1)[piece.start: piece.start + piece.model.numel()]
        if flat.numel() < piece.model.numel():  # a padded shard: padding is zero
            flat = torch.cat([flat, flat.new_zeros(piece.model.numel() - flat.numel())])
        return flat.to(piece.model.device)

    # ------------------------------------------------------------ the torch optimizer face

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    # ------------------------------------------------------------ one step

    def prepare_grads(self, inv_scale: float | torch.Tensor = 1.0) -> tuple[list[nn.Parameter], list[Placement]]:
        """Give every master its fp32, unscaled gradient; returns (masters, placements) for the norm.

        `inv_scale`: 1 / the loss scale, a number or a 0-dim tensor (fp16's scaler keeps it on the device)."""
        scaled = isinstance(inv_scale, torch.Tensor) or inv_scale != 1.0
        grads = [piece.grad().detach() for piece in self.pieces]  # views: nothing is launched
        own = [alias and not scaled for alias in self.aliased]  # the model's own fp32 gradient, no copy
        for master, grad in zip(self.masters, fp32_grads(grads, own, self.host, inv_scale)):
            master.grad = grad
        return self.masters, self.placements

    def grad_norms(self) -> list[torch.Tensor] | None:
        """Each master's gradient norm when the gradients are not on the masters (None: the norm reads
        `.grad`; parallel.offload=nvme streams ZeRO-3's gradients and gives their norms instead)."""
        return None

    def clip(self, params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
        """Scale the gradients `prepare_grads` gave by min(1, max_norm / (norm + 1e-6)) (torch's rule)."""
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook()` before every step (checkpoint.state.UpdateGuard): an async checkpoint
        snapshot in flight must finish before the update changes what it copies."""
        self._pre_hooks.append(hook)

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """The update of the masters, then the model's pieces from them, then `after_step` (all-gathers).

        `found_inf`: a 0-dim flag; where it is set the fused kernel leaves masters, states and step
        counts as they were (the copies back and the gathers then move unchanged values). Read on
        the host only without a fused kernel (CPU masters, 1-bit Adam)."""
        for hook in self._pre_hooks:
            hook()
        if found_inf is not None and not self.inner.defaults.get("fused"):
            if bool(found_inf):  # a host read: only without a fused kernel (CPU, 1-bit Adam)
                for master in self.masters:  # nothing changes; the gradients are dropped
                    master.grad = None
                return
            found_inf = None
        if found_inf is not None:
            self.inner.found_inf = found_inf.to(self.host, torch.float32)  # a host read only with offload
        self.inner.step()
        self.inner.found_inf = None
        self.steps += 1
        copies = [(piece.model, master) for piece, master, alias in zip(self.pieces, self.masters, self.aliased)
                  if not alias]
        if copies:  # the updated pieces into the model (cast to its dtype): one multi-tensor copy
            models, masters = zip(*copies)
            torch._foreach_copy_(list(models), list(masters), non_blocking=True)
        for master in self.masters:
            master.grad = None
        if self.after_step is not None:
            self.after_step()

    # ------------------------------------------------------------ memory and checkpoints

    def state_tensors(self) -> list[torch.Tensor]:
        """Masters not shared with the model, and the optimizer states (scalars such as `step` excluded)."""
        out = [m for m, alias in zip(self.masters, self.aliased) if not alias]
        for master in self.masters:
            out += [v for v in self.inner.state[master].values() if v.dim() > 0]
        return out

    def named_state(self) -> list[tuple[Placement, torch.Tensor]]:
        """Every state tensor as a part of a global tensor `optimizer.<kind>.<parameter>`.

        The placement is the piece's (same box and flat range, replicated over the axes the piece
        is replicated over), renamed. Aliased masters are the model's parameters and are not listed.
        """
        out = []
        for piece, master, alias in zip(self.pieces, self.masters, self.aliased):
            state = self.inner.state[master]
            if not alias:
                out.append((replace(piece.placement, name=f"optimizer.master.{piece.placement.name}"), master))
            for kind in self.kinds(master):
                out.append((replace(piece.placement, name=f"optimizer.{kind}.{piece.placement.name}"), state[kind]))
        return out

    def step_count(self) -> int:
        return self.steps

    def _set_step(self, step: int) -> None:
        self.steps = step
        for master in self.masters:
            counter = self.inner.state[master].get("step")
            if counter is not None:  # Adam's per-tensor count (its bias corrections depend on it)
                counter.fill_(float(step))

    @torch.no_grad()
    def after_load(self, step: int, masters_loaded: bool) -> None:
        """After a checkpoint filled the states in place: set the step count and make masters
        and model agree (from the loaded masters, or, written without them, from the model)."""
        self._set_step(step)
        for piece, master, alias in zip(self.pieces, self.masters, self.aliased):
            if alias:
                continue
            if masters_loaded:
                piece.model.copy_(master)
            else:
                master.copy_(piece.model)

    @torch.no_grad()
    def load_named_state(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Fill the states from {placement name: local tensor} (as `named_state` names them)."""
        for piece, master, alias in zip(self.pieces, self.masters, self.aliased):
            state = self.inner.state[master]
            key = f"optimizer.master.{piece.placement.name}"
            if not alias and key in tensors:
                master.copy_(tensors[key])
                piece.model.copy_(master)
            for kind in self.kinds(master):
                state[kind].copy_(tensors[f"optimizer.{kind}.{piece.placement.name}"])
        self._set_step(step)
