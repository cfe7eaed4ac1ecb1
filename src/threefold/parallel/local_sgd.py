"""Periodic synchronisation over dp: local SGD, DiLoCo and elastic averaging SGD (EASGD).

Instead of summing gradients over dp every step, each dp *replica* steps alone on its share of
the global batch and the replicas meet every `train.sync_every` = H steps (docs/local_sgd.md):

    local SGD   (outer_optimizer=none)       every replica takes the average of the replicas
    DiLoCo      (outer_optimizer=nesterov)   the outer parameters theta take one Nesterov momentum
                                             step on delta = theta - average (outer_lr, outer_momentum);
                                             every replica restarts from the new theta
    EASGD       (easgd_alpha = a > 0)        replica i: x_i -= a (x_i - c); centre: c += a sum_i (x_i - c)

A replica is one dp rank, or, with node axes (`compress.hierarchical=true` on several nodes),
one node: gradients are then summed every step over `dp_intra` inside the node, and the
average crosses `dp_inter` only at syncs. Nothing crosses the averaged axis between syncs.

Between syncs a replica's gradient is the gradient of *its* mean loss: the step divides each
micro-batch by the global token count, so the (inner) sum is scaled by the number of
replicas. Clipping uses the replica's own gradient norm. `sync_warmup_steps` steps of ordinary
synchronous data parallelism come first (post-local SGD); H=1 local SGD with momentum-free SGD
is synchronous SGD.

The average is one all-reduce per gradient bucket of the fp32 masters, bucket for bucket the
all-reduces a synchronous step makes (with an fp32 wire), so the bytes over the averaged axis
fall by exactly H. With node axes the node's leader all-reduces over dp_inter and broadcasts in
the node (as the hierarchical gradient sum does). `sync_optimizer_state` averages the
optimizer's moments the same way.

State: DiLoCo's outer parameters and momentum and EASGD's centre are the same on every replica
and checkpoint as `optim/<param>/outer_params|outer_momentum|easgd_centre` with the parameter's
placement, so they load under any layout. What differs between replicas (each one's masters and
optimizer moments) is rank state: restored bitwise under the same layout; under another layout
every replica starts from replica 0's copy (the model and optimizer tensors of the checkpoint).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from ..comm import Comm
from ..comm.compression import DenseHook
from ..comm.compression.hook import StatelessHook
from ..config import TrainConfig
from ..sharding import Placement
from .buckets import Bucket
from .master import Piece, ShardedOptimizer, state_kinds

OUTER_KINDS = {"nesterov": ("outer_params", "outer_momentum"), "easgd": ("easgd_centre",), "none": ()}


class LocalHook(StatelessHook):
    """The gradient hook of a periodic run: the usual dense sum during the warm-up, afterwards
    only inside the replica (`inner` axis, or none), scaled to the replica's mean gradient."""

    def __init__(self, dense: DenseHook, inner: str | None, replicas: int, wire_dtype: torch.dtype | None):
        self.dense = dense
        self.inner = inner
        self.inner_hook = DenseHook(wire_dtype)
        self.replicas = replicas
        self.local = False  # set by PeriodicSync.begin_step

    def launch(self, bucket: Bucket, comm: Comm, axis: str):
        if not self.local:
            return self.dense.launch(bucket, comm, axis)
        if self.inner is None:
            return None  # nothing to sum: the replica is this rank
        return self.inner_hook.launch(bucket, comm, self.inner)

    def complete(self, bucket: Bucket) -> None:
        (self.inner_hook if self.local else self.dense).complete(bucket)
        if self.local and self.replicas > 1:
            bucket.buffer.mul_(self.replicas)


class PeriodicSync:
    """When and how the replicas meet; owns the outer state and this rank's replica state."""

    def __init__(self, comm: Comm, cfg: TrainConfig, hook: LocalHook, groups: list[list[int]]):
        mesh = comm.mesh
        self.comm = comm
        self.cfg = cfg
        self.hook = hook
        self.hierarchical = mesh.has_node_axes()
        self.axis = "dp_inter" if self.hierarchical else mesh.replica_axis  # the averaged axis
        self.inner = "dp_intra" if self.hierarchical else None
        self.replicas = mesh.size(self.axis)
        self.groups = groups  # piece indices per gradient bucket, in bucket order
        self.kind = "easgd" if cfg.easgd_alpha > 0 else cfg.outer_optimizer
        self.step = 0
        self.syncs = 0
        self._update_pre_hooks: list = []
        self.pieces: list[Piece] = []
        self.masters: list[nn.Parameter] = []
        self.aliased: list[bool] = []
        self.outer: dict[str, list[torch.Tensor]] = {}
        self.optimizer: ShardedOptimizer | None = None

    # ------------------------------------------------------------ the schedule

    def local(self, step: int) -> bool:
        """Whether step `step` (1-based) runs without the every-step gradient sum over the averaged axis."""
        return step > self.cfg.sync_warmup_steps

    def syncs_after(self, step: int) -> bool:
        warmup = self.cfg.sync_warmup_steps
        return step > warmup and (step - warmup) % self.cfg.sync_every == 0

    @property
    def norm_axis(self) -> str | None:
        """The axis standing for dp in this step's gradient norm: the replica's own gradient when local."""
        return self.inner if self.hook.local else self.comm.mesh.replica_axis

    def begin_step(self, step: int) -> None:
        self.step = step
        self.hook.local = self.local(step)

    def end_step(self) -> None:
        """After the replica's optimizer step (or skipped step): meet when the period is over."""
        if self.syncs_after(self.step):
            self.sync()
        elif self.step == self.cfg.sync_warmup_steps:  # the replicas are equal: the outer state starts here
            self._reset_outer()

    # ------------------------------------------------------------ binding to the optimizer

    def make_optimizer(self, pieces: list[Piece], cfg: TrainConfig, fp32_init: dict[str, torch.Tensor],
                       offload: bool, after_step: Callable[[], None] | None) -> PeriodicOptimizer:
        """The replica's own optimizer over `pieces` (a ShardedOptimizer), then this sync when a period ends."""
        return PeriodicOptimizer(pieces, cfg, fp32_init, offload, after_step, sync=self)

    def bind(self, optimizer: ShardedOptimizer) -> None:
        self.optimizer = optimizer
        self.pieces, self.masters, self.aliased = optimizer.pieces, optimizer.masters, optimizer.aliased
        self.outer = {kind: [torch.zeros_like(m) for m in self.masters] for kind in OUTER_KINDS[self.kind]}
        self._reset_outer()

    @torch.no_grad()
    def _reset_outer(self) -> None:
        start = self.outer.get("outer_params") or self.outer.get("easgd_centre") or []
        for held, master in zip(start, self.masters):
            held.copy_(master)
        for momentum in self.outer.get("outer_momentum", []):
            momentum.zero_()

    # ------------------------------------------------------------ the meeting

    def _reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum each bucket's slice of `tensors` over the averaged axis; returns the flat sums per bucket."""
        sums = []
        for group in self.groups:
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in group])
            if self.hierarchical and self.comm.mesh.size(self.inner) > 1:
                if self.comm.mesh.rank(self.inner) == 0:  # the node's leader crosses nodes
                    self.comm.all_reduce(flat, self.axis)
                self.comm.broadcast(flat, self.inner, src=0)
            else:
                self.comm.all_reduce(flat, self.axis)
            sums.append(flat)
        return sums

    def _per_tensor(self, sums: list[torch.Tensor]):
        """(piece index, that piece's slice of the bucket sums), in bucket order."""
        for group, flat in zip(self.groups, sums):
            offset = 0
            for i in group:
                n = self.masters[i].numel()
                yield i, flat[offset: offset + n].view_as(self.masters[i])
                offset += n

    @torch.no_grad()
    def sync(self) -> None:
        for hook in self._update_pre_hooks:
            hook()
        r, cfg = self.replicas, self.cfg
        sums = self._reduce(self.masters)
        for i, total in self._per_tensor(sums):
            master = self.masters[i]
            if self.kind == "easgd":
                centre = self.outer["easgd_centre"][i]
                master.sub_(cfg.easgd_alpha * (master - centre))  # towards the old centre
                centre.add_(cfg.easgd_alpha * (total - r * centre))  # sum_i (x_i - c), with the x_i before the pull
            elif self.kind == "nesterov":
                theta, momentum = self.outer["outer_params"][i], self.outer["outer_momentum"][i]
                delta = theta - total / r  # the outer gradient
                momentum.mul_(cfg.outer_momentum).add_(delta)
                theta.sub_(cfg.outer_lr * (delta + cfg.outer_momentum * momentum))
                master.copy_(theta)
            else:
                master.copy_(total / r)
        if self.cfg.sync_optimizer_state:
            self._average_states()
        for piece, master, alias in zip(self.pieces, self.masters, self.aliased):
            if not alias:
                piece.model.copy_(master)
        self.syncs += 1

    def _average_states(self) -> None:
        inner = self.optimizer.inner
        for kind in state_kinds(inner):
            states = [inner.state[m][kind] for m in self.masters]
            for i, total in self._per_tensor(self._reduce(states)):
                states[i].copy_(total / self.replicas)

    # ------------------------------------------------------------ checkpoints

    def named_state(self) -> list[tuple[Placement, torch.Tensor]]:
        """The outer state, equal on every replica: `optimizer.<kind>.<parameter>` with the piece's placement."""
        return [(replace(piece.placement, name=f"optimizer.{kind}.{piece.placement.name}"), held[i])
                for kind, held in self.outer.items() for i, piece in enumerate(self.pieces)]

    def outer_tensors(self) -> list[torch.Tensor]:
        return [t for held in self.outer.values() for t in held]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This replica's own masters and optimizer moments (they differ between replicas)."""
        out = {f"replica.master.{i}": m for i, m in enumerate(self.masters)}
        if self.optimizer is not None:
            inner = self.optimizer.inner
            for kind in state_kinds(inner):
                out.update({f"replica.{kind}.{i}": inner.state[m][kind] for i, m in enumerate(self.masters)})
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        held = self.state_dict()
        for key, tensor in state.items():
            if key not in held or held[key].shape != tensor.shape:
                raise ValueError(f"replica state '{key}' does not fit this model's optimizer pieces")
            held[key].copy_(tensor)
        for piece, master, alias in zip(self.pieces, self.masters, self.aliased):
            if not alias:
                piece.model.copy_(master)

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before a sync changes the replica state (an async checkpoint's guard)."""
        self._update_pre_hooks.append(hook)


class PeriodicOptimizer(ShardedOptimizer):
    """The replica's own optimizer (ShardedOptimizer), then the sync when the period ends."""

    def __init__(self, *args, sync: PeriodicSync, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync = sync
        sync.bind(self)

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        super().step(found_inf)  # skipped or not (found_inf), the step counts for the period
        self.sync.end_step()

    def state_tensors(self) -> list[torch.Tensor]:
        return super().state_tensors() + self.sync.outer_tensors()

    def named_state(self) -> list[tuple[Placement, torch.Tensor]]:
        return super().named_state() + self.sync.named_state()


def periodic_hook(hook: DenseHook, comm: Comm, wire_dtype: torch.dtype | None) -> LocalHook:
    """Wrap the dense gradient hook of a periodic run (the averaged axis: dp, or dp_inter with node axes)."""
    mesh = comm.mesh
    if mesh.has_node_axes():
        return LocalHook(hook, "dp_intra" if mesh.size("dp_intra") > 1 else None, mesh.size("dp_inter"), wire_dtype)
    return LocalHook(hook, None, mesh.size(mesh.replica_axis), wire_dtype)


def periodic_sync(comm: Comm, cfg: TrainConfig, hook: LocalHook, buckets: list[Bucket],
                  params: list[nn.Parameter]) -> PeriodicSync:
    """The sync over the gradient buckets' grouping of `params` (the pieces' order)."""
    index = {id(q): i for i, q in enumerate(params)}
    return PeriodicSync(comm, cfg, hook, [[index[id(q)] for q in b.params] for b in buckets])
