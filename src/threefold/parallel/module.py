"""A user's own `nn.Module` under the strategies that need no plan: dp, ZeRO 1-3, precision, remat, compile.

`parallelize` (parallel/__init__.py) takes this path for a ModelSpec with `module_loss` (the CLI's
`py:MODULE:FACTORY`), and `threefold.prepare` (engine.py) for any live module. The strategies are
threefold's own (buckets, ZeRO's shards, the fp32-master optimizer), so Comm counts every byte; what
the module path does differently from the reference families:

    units      ZeRO-3's gather/release units and the activation-checkpointing regions are chosen by
               module class (every outermost submodule of one of the classes, as FSDP2's per-block
               wrapping) or by a list of submodule names; by default the items of top-level
               ModuleLists / Sequentials and the other top-level children (parallel/units.py).
               Parameters outside every unit form the root unit (whole from the forward to the end of
               the backward).
    start      the module's own values, broadcast from dp rank 0 (the factory's seeded init, or whatever
               the user loaded); nothing is built on the meta device.
    loss       `loss_of(module, micro_batch)`: the value to divide by `global_tokens` before backward
               (the CLI: summed token cross-entropy over the global token count; the engine: the user's
               mean loss over dp x micro-batches, DDP's convention).
    buffers    floating-point buffers (batch-norm running statistics) are averaged over dp after every
               step's forwards (`buffers="synced"`, one all-reduce tagged `buffers`) or left to each rank
               (`"local"`; checkpoints then hold dp rank 0's). Integer buffers (counters) agree anyway.

Frozen parameters are skipped by every sync (buckets, ZeRO shards without gradient storage); a
parameter used twice accumulates once per backward; a parameter unused in a step keeps a zero
gradient - buckets launch in order at `finish()`, ZeRO-3 reduces unreached units at the end of the
pass - so nothing waits for a gradient that never comes (DDP's find_unused_parameters, without the
extra graph walk).

    plan       tensor parallelism where the caller gives a plan (`tensor_plan`): a TensorPlan, or a
               dict {submodule pattern: "colwise" | "rowwise"} as torch's parallelize_module takes -
               a colwise Linear keeps its rank's output features (its input enters the tp group:
               identity forward, all-reduce backward), a rowwise Linear its rank's input features
               (partial products all-reduced forward). Everything else is replicated over tp and,
               when the plan is right, gets the same gradient on every tp rank. Without a plan
               tp > 1 is refused.

Refused in one line (ConfigError): tp without a plan; pp, ep and cp (a plain module has no stage,
expert or sequence plan: these run for the model families, `threefold train --model`); sequence
parallelism; periodic sync, NVMe offload, hpZ, activation offload, remat policies other than none/full.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..comm import Comm
from ..config import Config
from ..errors import ConfigError
from ..mesh import TENSOR, Mesh
from ..sharding import Placement
from . import steps
from .comm_hook import make_comm_hook
from .compose import Build, compose, finish
from .model import ParallelModel
from .remat import checkpointed
from .sync_kinds import SyncOptions
from .tensor import AXIS as TP_AXIS
from .tensor_plan import (ColumnParallel, RowParallel, TensorPlan, TensorPlanError, matching_modules,
                          parallelize_tensor)
from .units import unit_modules

LossOf = Callable[[nn.Module, object], torch.Tensor]  # (module, micro-batch) -> loss, divided by global_tokens
Units = Sequence[type] | Sequence[str] | None  # module classes, submodule names, or None: the default cut
Plan = TensorPlan | dict[str, str] | None  # tensor parallelism: a TensorPlan, or {pattern: "colwise" | "rowwise"}
STYLES = {"colwise": ColumnParallel, "rowwise": RowParallel}


def tensor_plan(plan: Plan) -> TensorPlan | None:
    """A TensorPlan from the caller's `plan`: a dict's colwise layers are each their own region (their
    input enters the tp group), its rowwise layers sum their partial products over tp."""
    if plan is None or isinstance(plan, TensorPlan):
        return plan
    if not isinstance(plan, dict):
        raise ConfigError("plan", f"give a TensorPlan or a dict {{pattern: 'colwise' | 'rowwise'}}, not "
                          f"{type(plan).__name__}")
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError("plan", f"'{pattern}': style '{style}' is not one of {', '.join(STYLES)}")
    return TensorPlan(layers={pattern: STYLES[style]() for pattern, style in plan.items()},
                      regions=tuple(pattern for pattern, style in plan.items() if style == "colwise"),
                      supports_sequence_parallel=False)


def choose_units(model: nn.Module, units: Units, key: str = "units") -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit: the outermost submodules of the given classes, the named
    submodules, or (None) the items of top-level containers and the other top-level children."""
    if units is None:
        return unit_modules(model)
    units = list(units)
    if all(isinstance(u, str) for u in units):
        out = []
        for name in units:
            try:
                out.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ConfigError(key, f"'{name}' is not a submodule of {type(model).__name__}") from None
        return out
    if not all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
        raise ConfigError(key, "give nn.Module classes (e.g. [nn.TransformerEncoderLayer]) or submodule names")
    classes = tuple(units)
    out, taken = [], []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, classes) and next(module.parameters(), None) is not None:
            out.append((name, module))
            taken.append(name)
    if not out:
        raise ConfigError(key, f"{type(model).__name__} has no submodule of class "
                          f"{', '.join(c.__name__ for c in classes)}")
    return out


@dataclass
class ModuleParallel(ParallelModel):
    """`ParallelModel` of a user's module: its forward and backward run through `loss_of`."""

    loss_of: LossOf | None = None
    synced_buffers: bool = True  # floating buffers averaged over dp after each step's forwards
    buffer_names: list[str] = field(default_factory=list)  # persistent buffers, saved in checkpoints

    def forward_backward(self, micro_batches: list, global_tokens: float,
                         loss_scale: float | torch.Tensor = 1.0, before=None) -> torch.Tensor:
        if before is not None:  # packed rows (data.pack) are refused for a plain module (refuse_unplanned)
            raise ValueError("a plain module takes no per-micro-batch document ids")
        scaled = isinstance(loss_scale, torch.Tensor) or loss_scale != 1.0
        total = None
        for i, mb in enumerate(micro_batches):
            with self.grad_sync.micro_batch(last=i == len(micro_batches) - 1):
                self.meter.reset()
                with self.meter.measure():
                    loss = self.loss_of(self.module, mb)
                scaled_loss = loss / global_tokens
                (scaled_loss * loss_scale if scaled else scaled_loss).backward()
            loss = loss.detach().float()
            total = loss if total is None else total + loss
        if self.module.training:
            self.sync_buffers()
        return total

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Average the floating-point buffers over the replicas (one all-reduce per dtype), when synced."""
        axis = self.comm.mesh.replica_axis
        n = self.comm.mesh.size(axis)
        if not self.synced_buffers or n == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():
            if b.is_floating_point():
                by_dtype.setdefault(b.dtype, []).append(b)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            self.comm.all_reduce(flat, axis, tag="buffers")
            flat /= n
            for b, value in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(value.view_as(b))

    def checkpoint_tensors(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Placement]]:
        """Parameters and persistent buffers with their placements: what a checkpoint holds."""
        buffers = dict(self.module.named_buffers())
        named = list(self.module.named_parameters()) + [(n, buffers[n]) for n in self.buffer_names]
        places = {**self.placements, **{n: Placement.whole(n, tuple(buffers[n].shape)).replicated(self.comm.mesh.replica_axis)
                                        for n in self.buffer_names}}
        return named, places


def refuse_unplanned(cfg: Config, planned: bool = False) -> None:
    """One ConfigError for what a plain module cannot take (no plan) or what its path does not support yet."""
    p, r = cfg.parallel, cfg.remat
    if p.tp > 1 and not planned:
        raise ConfigError("parallel.tp", f"{p.tp} needs a tensor plan, which a plain nn.Module does not have; give "
                          "plan={'pattern': 'colwise' | 'rowwise'} to threefold.prepare or use parallel.tp=1")
    for key, value, what in (("parallel.pp", p.pp, "pipeline stages"), ("parallel.ep", p.ep, "expert layers"),
                             ("parallel.cp", p.cp, "an attention to split by sequence")):
        if value > 1:
            raise ConfigError(key, f"{value} needs {what}, which a plain nn.Module does not declare; train a model "
                              f"family (threefold train --model ...) or use {key}=1")
    if cfg.data.pack:  # the batches are the caller's, and a plain module has no attention seam to mask
        raise ConfigError("data.pack", "packed rows need the document mask of threefold's own decoder, which a "
                          "plain nn.Module does not have; set data.pack=false")
    refused = (("parallel.sequence_parallel", p.sequence_parallel and p.tp > 1, "sequence parallelism"),
               ("train.sync_every", cfg.train.periodic, "periodic sync"),
               ("parallel.offload", p.offload == "nvme", "offload=nvme"),
               ("parallel.zero_hpz", p.zero_hpz, "hpZ"),
               ("remat.offload", r.offload != "none", "activation offload"),
               ("remat.policy", r.policy not in ("none", "full"), f"remat.policy={r.policy}"))
    for key, bad, what in refused:
        if bad:
            raise ConfigError(key, f"{what} is not supported for a plain nn.Module yet (remat: none or full, "
                              "regions chosen by class); drop it")


def parallelize_module(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config, loss_of: LossOf,
                       units: Units = None, remat: Units = None, buffers: str = "synced",
                       plan: Plan = None) -> ModuleParallel:
    """The module on this rank's device under cfg's tp (by `plan`) / dp / ZeRO stage, precision, remat, compile:
    the steps below and parallel/steps.py's precision and replicas, composed over one `Build`."""
    plan = tensor_plan(plan)
    refuse_unplanned(cfg, plan is not None)
    if buffers not in ("synced", "local"):
        raise ConfigError("buffers", f"'{buffers}': choose synced (averaged over dp) or local")
    p, partial = cfg.parallel, functools.partial
    options = SyncOptions(p.bucket_mb, p.zero_weight_comm, p.zero_grad_comm, make_hook=partial(make_comm_hook, cfg.compress, cfg.train.grad_clip, cfg.train.seed))
    build = compose([start,
                     partial(plan_tensor, plan=plan),
                     partial(pick_units, units=units),
                     partial(remat_units, policy=cfg.remat.policy, remat=remat),
                     partial(steps.precision, cfg=cfg.precision),
                     partial(steps.replicas, zero=p.zero, compress=cfg.compress.method, options=options,
                             replica_axes=(mesh.replica_axis,)),
                     partial(compile_units, enabled=cfg.train.compile, backend=cfg.debug.compile_backend)],
                    Build(mesh, comm, model=model, zero=p.zero, offload=p.offload))
    persistent = [n for n, _ in model.named_buffers() if _persistent(model, n)]
    return finish(build, ModuleParallel, loss_of=loss_of, synced_buffers=buffers == "synced",
                  buffer_names=persistent)


def start(b: Build) -> None:
    """The module on this rank's device, every rank from rank 0's values (parameters and buffers), before tp
    cuts them; each parameter whole until a step places it."""
    mesh, model = b.mesh, b.model
    model.to(mesh.device)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            for axis in (mesh.replica_axis, *mesh.axes_where(TENSOR)):
                if mesh.size(axis) > 1:
                    b.comm.broadcast(t.data, axis, src=0)
    b.placements = {n: Placement.whole(n, tuple(q.shape)) for n, q in model.named_parameters()}


def plan_tensor(b: Build, plan: TensorPlan | None) -> None:
    """Tensor parallelism by the caller's plan (refusing a pattern that names no module, at any tp)."""
    if plan is None:
        return
    try:
        if b.mesh.size(TP_AXIS) > 1:
            b.placements = parallelize_tensor(b.model, b.mesh, b.comm, plan)
        else:  # tp = 1 cuts nothing, but a pattern that names no module is a mistake at any size
            for pattern in (*plan.layers, *plan.regions):
                matching_modules(b.model, pattern)
    except TensorPlanError as e:
        raise ConfigError("plan", str(e).removeprefix("tensor plan: ")) from None


def pick_units(b: Build, units: Units) -> None:
    """ZeRO's gather/release units (and the default remat regions): by class, by name, or the default cut."""
    b.units = choose_units(b.model, units)


def remat_units(b: Build, policy: str, remat: Units) -> None:
    """Activation checkpointing (`remat.policy=full`): each region's forward recomputed in backward (hooks
    stay outside it); the regions are the units unless `remat` names others."""
    if policy != "full":
        return
    regions = b.units if remat is None else choose_units(b.model, remat, "remat")
    for _, module in regions:
        module.forward = checkpointed(module.forward)
    b.regions = [n for n, _ in regions]


def compile_units(b: Build, enabled: bool | str, backend: str) -> None:
    """`train.compile=true`: each unit compiled (settled for the device: an unsettled auto stays eager)."""
    if enabled is not True:
        return
    from .compile import keep_eager

    keep_eager()
    for _, module in b.units:
        module.forward = torch.compile(module.forward, backend=backend, dynamic=False)


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr not in model.get_submodule(owner)._non_persistent_buffers_set
