"""Expert parallelism: the experts of each mixture-of-experts block spread over the mesh's `ep` axis.

`ep` is carved out of dp (mesh.py): the dp ranks are cut into runs of `ep` consecutive
coordinates; each run shares one copy of every expert, rank i of the run holding experts
[i E/ep, (i+1) E/ep) - a split of the stacked expert weights along their first dimension,
recorded in the placement, so checkpoints reshard across any ep like any other split.
Routing is unchanged (every rank routes its own tokens over all E experts with its copy of the
router); the routed rows travel to the rank of their expert and back with all-to-all over `ep`
through `Comm` (`AllToAllDispatch`): first the row counts per expert (`all_to_all.splits`),
then the rows (`all_to_all`), the experts' outputs back the same way, and backward the
gradients of both in reverse. With h the hidden size and d the dtype size, one rank sends per
step 2 x (rows it sends to other ranks + rows it receives from them) x h x d bytes of
`all_to_all`; over a whole ep group 4 x (routed rows crossing ranks) x h x d.

Gradients: dense parameters are summed over all of dp; expert parameters over `edp` only (the
dp ranks holding the same experts) - the all-to-all already brought every token of the ep run
to its expert (`ExpertParallelSync`: plain sums, or ZeRO-1/2 reduce-scatters with the
optimizer states sharded over dp and edp respectively). The expert reductions run after the
backward, in bucket order, so every rank issues them alike whatever experts its tokens used.

Under context parallelism the experts are replicated over cp as well (every cp rank of an ep
run holds the same experts and routes its zigzag part of the same sequences; the all-to-all
stays on ep, whose groups are cut from the dp group of each (pp, cp, tp) coordinate): the dense
parameters are summed over dp+cp as without experts, the experts over edp and cp together, in
one collective over the Mesh's `expert_replica_axis` (the joined "edp+cp", or "cp" when edp has
one member), on which ZeRO 1-3 shard the experts' states too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed
from torch import nn

from ..comm import Comm
from ..comm.autograd import all_to_all_rows, reduce_from_group
from ..mesh import BATCH, SEQUENCE, Mesh
from ..models.moe import Experts, moe_modules
from ..sharding import Placement
from .model import HooklessSync

AXIS = "ep"


class AllToAllDispatch:
    """An `ExpertDispatch` (models/moe.py) for experts spread over the `ep` axis."""

    def __init__(self, comm: Comm, axis: str = AXIS):
        self.comm, self.axis = comm, axis

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        n = self.comm.mesh.size(self.axis)
        local = counts.numel() // n
        splits = [local] * n
        received_counts = torch.empty_like(counts)  # (source rank, my expert) counts
        self.comm.all_to_all_v(received_counts, counts.contiguous(), splits, splits, self.axis, tag="splits")
        by_source = received_counts.view(n, local)
        send = counts.view(n, local).sum(1).tolist()
        receive = by_source.sum(1).tolist()
        arrived = all_to_all_rows(rows, self.comm, self.axis, receive, send)
        order = _group_by_expert(by_source)  # arrived rows are by source, then expert: regroup by expert
        out = experts(arrived[order], by_source.sum(0).tolist())[torch.argsort(order)]
        return all_to_all_rows(out, self.comm, self.axis, send, receive)


def _group_by_expert(by_source: torch.Tensor) -> torch.Tensor:
    """Row indices that take rows ordered (source, expert) to the order (expert, source)."""
    counts = by_source.tolist()
    starts, at = [], 0
    for row in counts:
        starts.append([])
        for c in row:
            starts[-1].append(at)
            at += c
    parts = [torch.arange(starts[s][e], starts[s][e] + counts[s][e]) for e in range(len(counts[0]))
             for s in range(len(counts))]
    return torch.cat(parts).to(by_source.device) if parts else torch.zeros(0, dtype=torch.long,
                                                                             device=by_source.device)


def shard_experts(model: nn.Module, mesh: Mesh, comm: Comm, placements: dict[str, Placement]) -> set[str]:
    """Keep this rank's experts of every MoE block (on the meta device, before materialising) and
    route through all-to-all; updates `placements`; returns the expert parameters' names."""
    ep, rank = mesh.size(AXIS), mesh.rank(AXIS)
    names: set[str] = set()
    if ep == 1:
        return names
    for prefix, moe in moe_modules(model):
        for key, p in list(moe.experts.named_parameters(recurse=False)):
            local = torch.empty((p.shape[0] // ep, *p.shape[1:]), dtype=p.dtype, device=p.device)
            setattr(moe.experts, key, nn.Parameter(local, requires_grad=p.requires_grad))
            name = f"{prefix}.experts.{key}"
            placements[name] = placements[name].split(0, rank, ep)
            names.add(name)
        moe.dispatch = AllToAllDispatch(comm)
    return names


class ExpertParallelSync(HooklessSync):
    """The `GradSync` of expert parallelism: one sync for the dense parameters over dp (plain DP or
    ZeRO 1-2, as without experts), one for the expert parameters over edp (the same kind; both with
    cp under context parallelism: `Mesh.replica_axis` and `Mesh.expert_replica_axis`), which
    reduces after the backward only (every rank issues its collectives alike, whichever experts
    its tokens reached). `parallelize()` builds both."""

    kind = "expert parallelism"  # no compression under ep (config/checks.py refuses it)

    def __init__(self, dense, experts, expert_params: list[nn.Parameter]):
        self.dense, self.experts = dense, experts
        self._expert_ids = {id(p) for p in expert_params}

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        with self.dense.micro_batch(last), self.experts.micro_batch(last=False):
            yield

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor:
        return (self.experts if id(param) in self._expert_ids else self.dense).gradient_of(param)

    def gradient_tensors(self) -> list[torch.Tensor]:
        return self.dense.gradient_tensors() + self.experts.gradient_tensors()

    def weight_tensors(self) -> list[torch.Tensor]:
        return self.dense.weight_tensors() + self.experts.weight_tensors()

    def gather_for(self, params: list[nn.Parameter]) -> None:
        """Whole weights for a hook-less backward (ZeRO-3: dense ones over dp, experts over edp; each with cp)."""
        self.dense.gather_for(params)
        self.experts.gather_for(params)

    def register_update_pre_hook(self, hook) -> None:
        """Both syncs call `hook()` before they change what a checkpoint reads (ZeRO-1/2's all-gathers)."""
        self.dense.register_update_pre_hook(hook)
        self.experts.register_update_pre_hook(hook)


class AxisSequenceShards:
    """The `SequenceShards` (models/moe.py) of the mesh axes whose ranks hold the parts of every
    sequence: tp under sequence parallelism, cp under context parallelism, both (cp outer, tp inner:
    each cp rank's zigzag part split again over tp) under the two together. `sum` is an all-reduce
    over each axis with an identity backward (each holder differentiates the auxiliary loss through
    its own part; the router's and experts' gradient parts are then summed over the axes: tp like
    the norms', cp by the gradient sync); `gather` all-gathers the capacity counts, in holder order
    (`rank`: the coordinate over the axes, the later inner) - the order of positions for tp alone;
    capacity is refused under cp (config/checks.py), whose zigzag parts have no such order.
    `reports`: a holder reports when it is at coordinate 0 of every axis the loss is summed over
    (cp), whatever its coordinate on the others (tp): every tp rank, the first cp rank only."""

    def __init__(self, comm: Comm, axis: str | tuple[str, ...] = "tp"):
        self.comm = comm
        self.axes = (axis,) if isinstance(axis, str) else tuple(axis)
        mesh, summed = comm.mesh, comm.mesh.axes_where(BATCH, SEQUENCE)
        self.rank, self.size = 0, 1
        for a in self.axes:
            self.rank, self.size = self.rank * mesh.size(a) + mesh.rank(a), self.size * mesh.size(a)
        self.reports = all(mesh.rank(a) == 0 or a not in summed for a in self.axes)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        for a in self.axes:
            t = reduce_from_group(t, self.comm, a)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        shape, every = t.shape, t.reshape(1, -1).contiguous()
        for a in reversed(self.axes):  # the inner axis first: rows end in holder order, the later axes inner
            n = self.comm.mesh.size(a)
            out = torch.empty((n * every.shape[0], every.shape[1]), dtype=t.dtype, device=t.device)
            self.comm.all_gather(out, every, a, tag="moe")
            every = out
        return every.view(self.size, *shape)


def sequence_parallel_experts(model: nn.Module, comm: Comm) -> list[nn.Parameter]:
    """Under sequence parallelism: every MoE block routes its tp rank's part of each sequence and
    sums the statistics of whole sequences over tp; returns its parameters, whose gradients (from
    this rank's tokens only) are to be summed over tp."""
    params = []
    for _, moe in moe_modules(model):
        moe.sequence = AxisSequenceShards(comm)
        params += [p for p in moe.parameters() if p.requires_grad]
    return params


def context_parallel_experts(model: nn.Module, comm: Comm) -> None:
    """Under context parallelism: every MoE block routes this cp rank's zigzag part of each sequence
    (dropless: config/checks.py refuses a capacity) and sums the statistics of whole sequences over cp;
    a block that sequence parallelism gave the tp holders (`sequence_parallel_experts`, run first)
    holds 1/tp of that part: its statistics are summed over cp and tp."""
    for _, moe in moe_modules(model):
        within = moe.sequence.axes if isinstance(moe.sequence, AxisSequenceShards) else ()
        moe.sequence = AxisSequenceShards(comm, ("cp", *within))


def router_metrics(module: nn.Module, comm: Comm, pipelined: bool = False) -> dict | None:
    """Metrics of the routers since the last call, over the whole global batch (summed over dp, and
    over the pipeline stages when `pipelined`): tokens per expert (min / mean / max over every
    sparse block's experts, kept assignments), assignments dropped by the capacity, and `aux_loss`,
    the weighted auxiliary losses the logged loss includes (balance: mean over sequences, z-loss:
    mean over tokens; summed over blocks). None for a model without experts (every stage of a
    pipeline calls it: its stages without experts too). Called once per step, after the update: a
    block with `router_balance=bias` moves its expert bias by the summed load (`MoE.update_bias`; the
    same table on every rank of the block's stage, so every copy stays equal, with no extra collective)."""
    mods = moe_modules(module)
    if not mods and not pipelined:
        return None  # (a pipeline of a model without experts does not call it)
    device = comm.mesh.device
    # per rank: [-min kept, max kept] and [kept sum, expert count, dropped, aux, balance, z]
    extremes = torch.full((2,), -float("inf"), dtype=torch.float64, device=device)
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    if mods:
        table = torch.stack([moe.take_tally().row(moe.num_experts, device) for _, moe in mods])
        comm.all_reduce_over(table, comm.mesh.axes_where(BATCH, SEQUENCE), tag="moe")  # the tokens' shards
        kept, (dropped, balance, z, sequences, tokens) = table[:, :-5], table[:, -5:].unbind(1)
        for (_, moe), load in zip(mods, kept):  # router_balance=bias: the step's load moves the bias
            if moe.balance == "bias":
                moe.update_bias(load)
        weights = torch.tensor([[moe.aux_weight, moe.z_weight] for _, moe in mods], dtype=torch.float64,
                               device=device)
        balance_mean, z_mean = balance / sequences.clamp(min=1), z / tokens.clamp(min=1)
        aux = (weights[:, 0] * balance_mean + weights[:, 1] * z_mean).sum()
        extremes = torch.stack([-kept.min(), kept.max()])
        sums = torch.stack([kept.sum(), torch.tensor(float(kept.numel()), dtype=torch.float64, device=device),
                            dropped.sum(), aux, balance_mean.sum(), z_mean.sum()])
    if pipelined:
        comm.all_reduce(extremes, "pp", op=torch.distributed.ReduceOp.MAX, tag="moe")
        comm.all_reduce(sums, "pp", tag="moe")
    (low, high), (kept_sum, count, dropped, aux, balance, z) = extremes.tolist(), sums.tolist()
    if count == 0:  # a pipeline without experts
        return None
    return {"tokens_per_expert": {"min": int(-low), "mean": kept_sum / count, "max": int(high)},
            "dropped": int(dropped), "aux_loss": aux, "balance_loss": balance, "z_loss": z}
