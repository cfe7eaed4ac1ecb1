"""The data-parallel sync kinds: one registry (`SYNC_KINDS`, name -> how to wrap), read by both composition roots.

The last strategy step (`steps.replicas`, parallel/steps.py) hands every trainable parameter of this
rank's module to one kind, picked by `parallel.zero` and `train.sync_every` (`kind_name`):

    dp        plain data parallelism: bucketed all-reduce through the compression hook   (data.py)
    periodic  local SGD / DiLoCo / EASGD: dp's buckets, summed inside a replica between syncs
                                                                                      (local_sgd.py)
    zero1     optimizer states sharded over dp, gradients all-reduced                  (zero.py)
    zero2     optimizer states and gradients sharded over dp                           (zero.py)
    zero3     parameters too, gathered a unit at a time (hpZ's secondary copy, the NVMe home)
                                                                                      (zero3.py, hpz.py)

Each entry says how to wrap all parameters (`wrap`) and how to wrap them when expert parallelism
splits them in two (`wrap_experts`: dense over dp, experts over edp, parallel/expert.py), and returns
one typed `DpSync`: the gradient sync, the placements after it, the pieces the optimizer updates and
what runs around the step. A new kind is one entry here (and its module); nothing else dispatches on
the stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..comm import Comm
from ..comm.quantize import fp8_supported
from ..config import TrainConfig
from ..errors import ConfigError
from ..sharding import Placement
from .data import DataParallelReducer, parallelize_data
from .expert import ExpertParallelSync
from .hpz import NO_HPZ, secondary_partition
from .local_sgd import periodic_hook, periodic_sync
from .master import Piece
from .materialise import Deferred
from .model import GradSync, Periodic
from .nvme import ScratchSettings, ShardStore
from .zero import ZeroReducer
from .zero3 import Zero3

HookMaker = Callable[[int, "torch.dtype | None"], object]  # (replicas, wire dtype or None) -> the dp hook


@dataclass(frozen=True)
class SyncOptions:
    """The keys a sync kind reads (`parallel.*`, `train.*` of a periodic run), settled by the composition root."""

    bucket_mb: float = 25.0
    weight_comm: str = "none"  # ZeRO-3's parameter gathers: none | int8 | fp8
    grad_comm: str = "none"  # ZeRO-3's reduce-scatters: none | int8 | fp8
    hpz: bool = False  # ZeRO-3's secondary copy over dp_intra
    scratch: ScratchSettings | None = None  # parallel.offload=nvme: ZeRO-3's shards in a scratch file
    periodic: TrainConfig | None = None  # local SGD / DiLoCo / EASGD: the train section that times them
    make_hook: HookMaker | None = None  # the dp gradient hook (compression), plain dp and periodic


@dataclass
class SyncInput:
    """What the steps before the sync settled: this rank's module, its trainable parameters, their placements."""

    model: nn.Module
    comm: Comm
    named: list[tuple[str, nn.Parameter]]  # trainable parameters, local names
    placements: dict[str, Placement]
    wire: torch.dtype  # the gradients' dtype on the wire
    compute_dtype: torch.dtype
    replica_axes: tuple[str, ...]  # the axes a replicated placement names
    options: SyncOptions
    pipelined: bool = False  # a pipeline schedule drives the sync (ZeRO-2 defers, ZeRO-3 reduces per pass)
    deferred: Deferred | None = None  # ZeRO-3 fills the parameters unit by unit
    units: list[tuple[str, nn.Module]] | None = None  # a user's module: ZeRO's units (None: the families' cut)
    matmul_casts: dict | None = None  # fp8 matmuls whose weights ZeRO-3's fp8 gather sends cast


@dataclass
class DpSync:
    """One sync kind's result: what `ParallelModel` holds of it."""

    grad_sync: GradSync
    placements: dict[str, Placement]
    pieces: list[Piece]
    after_step: Callable[[], None] | None = None  # ZeRO-1/2's all-gather of the updated shards
    periodic: Periodic | None = None
    settle: Callable[[], None] | None = None  # ZeRO-1/2: wait for that all-gather
    shard_home: ShardStore | None = None  # nvme under ZeRO-3: the parameter shards' scratch file
    grad_home: ShardStore | None = None  # and the reduced gradients' (without a pipeline)


@dataclass(frozen=True)
class SyncKind:
    name: str
    wrap: Callable[[SyncInput], DpSync]  # every trainable parameter over the replica axes
    wrap_experts: Callable[[SyncInput, set[str]], DpSync]  # dense over dp, experts (by name) over edp


def whole_pieces(named, placements) -> list[Piece]:
    """Without ZeRO the optimizer updates every parameter whole: one piece per parameter."""
    return [Piece(name, placements[name], q.detach().view(-1), (lambda q=q: q.grad.view(-1)), q.dim() >= 2)
            for name, q in named]


def _replicated(s: SyncInput, axes: tuple[str, ...] | None = None) -> dict[str, Placement]:
    return {name: place.replicated(*(axes or s.replica_axes)) for name, place in s.placements.items()}


def _split(s: SyncInput, expert_names: set[str]):
    dense = [(n, q) for n, q in s.named if n not in expert_names]
    return dense, [(n, q) for n, q in s.named if n in expert_names]


def _expert_placements(s: SyncInput, expert_names: set[str]) -> dict[str, Placement]:
    mesh = s.comm.mesh
    return {name: place.replicated(*(mesh.expert_replica_axes if name in expert_names else s.replica_axes))
            for name, place in s.placements.items()}


# ------------------------------------------------------------ plain dp and its periodic form

def _plain(s: SyncInput, periodic: bool = False) -> DpSync:
    mesh, o = s.comm.mesh, s.options
    hook_wire = s.wire if s.wire != s.compute_dtype else None
    hook = o.make_hook(mesh.size(mesh.replica_axis), hook_wire)
    if periodic:  # between syncs, gradients are summed inside a replica only
        hook = periodic_hook(hook, s.comm, hook_wire)
    grad_sync = parallelize_data(s.model, s.comm, o.bucket_mb, hook)
    # local SGD / DiLoCo / EASGD: the replicas meet every train.sync_every steps, bucket by bucket
    meets = (periodic_sync(s.comm, o.periodic, hook, grad_sync.buckets.buckets, [q for _, q in s.named])
             if periodic else None)
    placements = _replicated(s)
    return DpSync(grad_sync, placements, whole_pieces(s.named, placements), periodic=meets)


def _plain_experts(s: SyncInput, expert_names: set[str]) -> DpSync:
    dense, experts = _split(s, expert_names)
    bucket_mb, axis = s.options.bucket_mb, s.comm.mesh.expert_replica_axis
    syncs = (DataParallelReducer([q for _, q in dense], s.comm, bucket_mb),
             DataParallelReducer([q for _, q in experts], s.comm, bucket_mb, axis=axis))
    placements = _expert_placements(s, expert_names)
    return DpSync(ExpertParallelSync(*syncs, [q for _, q in experts]), placements, whole_pieces(s.named, placements))


# ------------------------------------------------------------ ZeRO-1/2

def _zero12(s: SyncInput, stage: int) -> DpSync:
    # with a pipeline, stage 2 reduce-scatters after the last micro-batch (see zero.py)
    grad_sync = ZeroReducer(s.named, s.comm, stage, s.options.bucket_mb, s.wire, defer=s.pipelined)
    pieces = grad_sync.pieces(s.placements)  # optimizer states: sharded over dp
    if s.pipelined:  # the schedule runs stage modules out of order: the gather is waited for after the step
        after_step = grad_sync.gather_params
    else:  # the next forward waits for each segment it needs (zero.py); a user's module: each unit for its own
        grad_sync.overlap_gather(s.model, None if s.units is None else [m for _, m in s.units])
        after_step = grad_sync.defer_param_gather
    return DpSync(grad_sync, _replicated(s), pieces, after_step, settle=grad_sync.settle)


def _zero12_experts(s: SyncInput, expert_names: set[str], stage: int) -> DpSync:
    """Optimizer states sharded over dp (dense) and edp (experts), each with cp; the expert sync reduces in finish()."""
    dense, experts = _split(s, expert_names)
    bucket_mb, axis = s.options.bucket_mb, s.comm.mesh.expert_replica_axis
    syncs = (ZeroReducer(dense, s.comm, stage, bucket_mb, s.wire, defer=s.pipelined),
             ZeroReducer(experts, s.comm, stage, bucket_mb, s.wire, axis=axis, defer=True))
    pieces = syncs[0].pieces(s.placements) + syncs[1].pieces(s.placements)

    def after_step():
        syncs[0].gather_params()
        syncs[1].gather_params()
    return DpSync(ExpertParallelSync(*syncs, [q for _, q in experts]), _expert_placements(s, expert_names), pieces,
                  after_step)


# ------------------------------------------------------------ ZeRO-3

def _check_fp8_gather(s: SyncInput) -> None:
    if s.options.weight_comm == "fp8" and not fp8_supported(s.comm.mesh.device):
        raise ConfigError("parallel.zero_weight_comm", f"this torch cannot cast to float8_e4m3fn on "
                          f"{s.comm.mesh.device}; use parallel.zero_weight_comm=int8")


def _zero3(s: SyncInput) -> DpSync:
    _check_fp8_gather(s)
    o = s.options
    # with a pipeline, each schedule pass reduces only the units it reached (see zero3.py)
    home = ShardStore(o.scratch) if o.scratch is not None else None  # the shards in scratch too
    # and the reduced gradients, streamed by the step (a pipeline's passes keep theirs in memory)
    grad_home = ShardStore(o.scratch, "grads") if home is not None and not s.pipelined else None
    grad_sync = Zero3(s.model, s.comm, s.wire, stage_passes=s.pipelined, weight_comm=o.weight_comm,
                      grad_comm=o.grad_comm, hpz=secondary_partition(s.comm, s.pipelined) if o.hpz else NO_HPZ,
                      units=s.units, home=home, matmul_casts=s.matmul_casts, deferred=s.deferred,
                      grad_home=grad_home)
    return DpSync(grad_sync, grad_sync.placements(s.placements), grad_sync.pieces(s.placements),
                  shard_home=home, grad_home=grad_sync.grad_home if home is not None else None)


def _zero3_experts(s: SyncInput, expert_names: set[str]) -> DpSync:
    """Dense parameters sharded over dp (+cp), experts over edp (+cp): two ZeRO-3s on the one model."""
    _check_fp8_gather(s)
    dense, experts = _split(s, expert_names)
    o = s.options
    zero3 = {"wire_dtype": s.wire, "stage_passes": s.pipelined, "weight_comm": o.weight_comm,
             "grad_comm": o.grad_comm, "deferred": s.deferred}
    syncs = (Zero3(s.model, s.comm, **zero3, only={id(q) for _, q in dense}, matmul_casts=s.matmul_casts),
             Zero3(s.model, s.comm, axis=s.comm.mesh.expert_replica_axis, **zero3, only={id(q) for _, q in experts}))
    pieces = syncs[0].pieces(s.placements) + syncs[1].pieces(s.placements)
    return DpSync(ExpertParallelSync(*syncs, [q for _, q in experts]),
                  syncs[1].placements(syncs[0].placements(s.placements)), pieces)


SYNC_KINDS: dict[str, SyncKind] = {
    "dp": SyncKind("dp", _plain, _plain_experts),
    "periodic": SyncKind("periodic", functools.partial(_plain, periodic=True), _plain_experts),
    "zero1": SyncKind("zero1", functools.partial(_zero12, stage=1), functools.partial(_zero12_experts, stage=1)),
    "zero2": SyncKind("zero2", functools.partial(_zero12, stage=2), functools.partial(_zero12_experts, stage=2)),
    "zero3": SyncKind("zero3", _zero3, _zero3_experts),
}


def kind_name(zero: int, periodic: bool = False) -> str:
    """The registry's name for `parallel.zero` (and `train.sync_every`'s periodic form of plain dp)."""
    if zero == 0:
        return "periodic" if periodic else "dp"
    return f"zero{zero}"


def wire_dtype(zero: int, compress: str, reduce_dtype: torch.dtype) -> torch.dtype:
    """The gradients' wire dtype: mixed precision's, or ZeRO's only compression, a 16-bit wire."""
    if zero >= 1 and compress in ("fp16", "bf16"):
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[compress]
    return reduce_dtype


def wrap(name: str, s: SyncInput, expert_names: set[str] = frozenset()) -> DpSync:
    """Wrap `s`'s parameters in the sync kind `name` (its expert form when `expert_names` is not empty)."""
    kind = SYNC_KINDS[name]
    return kind.wrap_experts(s, expert_names) if expert_names else kind.wrap(s)
