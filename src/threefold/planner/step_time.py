"""Step time = pipeline makespan of compute and tensor-parallel communication
             + data-parallel / ZeRO communication not hidden behind backward + optimizer update.

Per micro-batch on the slowest pipeline stage (first or last):
    forward   its matmuls at the rate their shapes reach (compute.py: roofline, tile and wave quantization,
              fused attention, memory-bound elementwise work, / compute_efficiency) + tensor-parallel
              all-reduces + pipeline p2p
    backward  2 x forward FLOPs + recomputation, same rate + tensor-parallel all-reduces + pipeline p2p
(the pipeline's sends and receives as the workload's software runs them: planner/pipeline_p2p.py)
Tensor parallelism (Megatron-LM) all-reduces the block's (b, s, h) activations twice in forward
and twice in backward (again twice for a fully recomputed forward); with sequence parallelism
these become reduce-scatter + all-gather pairs of the same volume, and the backward all-gathers
each region's saved sequence shard once more (the linears keep the shard, not the gathered input:
parallel/sequence_region.py SequenceRegion). They sit on the critical path, except that regather: only what
of it the backward work issued after it does not cover is charged (`_regather_exposed`).
The last stage also runs the cross-entropy's memory-bound passes over the logits (compute.py
`loss_seconds`, by the workload's software).

The pipeline's makespan comes from `threefold.pipeline.simulate` when that module is present
(the event simulator of the real schedules) and from the closed forms otherwise:
    gpipe, 1f1b   (m + p - 1) (F + B)
    interleaved   m (F + B) + (p - 1) (F + B) / v
    zb-h1         m (F + B) + (p - 1) (F + B - 2 W)       W = weight-gradient half of B

Mixtures of experts (planner/moe.py): a sparse block's MLP work (replicated over tp without
sequence parallelism) and, under expert parallelism, its all-to-alls on the critical path - less
what the schedule's overlapped pairs hide when the software overlaps them (`Workload.a2a_overlap`).

Context parallelism (cp > 1): each rank computes 1/cp of every sequence's tokens (their matmuls, and
their queries' attention on the whole sequence's keys: 1/cp of the causal work), and each block's
attention communicates over the cp group per method, forward and backward (planner/context_comm.py:
allgather's and ulysses' collectives exposed, the ring's hops overlapped with its block attention). A
mixture of experts routes the rank's own tokens (its expert work and its ep all-to-all rows are 1/cp of
the whole sequence's) and each sparse block all-reduces its routing statistics over cp (small, exposed).

Data-parallel and ZeRO traffic, and how much of it is exposed: planner/dp_comm.py (also local
SGD / DiLoCo meetings, quantized ZeRO-3 communication and hpZ).
Compute that such a collective overlaps runs slower (NCCL's kernels hold multiprocessors and HBM bandwidth):
`overlap_interference` charges the hidden seconds at the GPU's published `overlap_slowdown` (hardware.py).
The optimizer update is memory-bound: its bytes per local parameter (AdamW 32) over HBM bandwidth; Muon adds
the busiest owner's Newton-Schulz work and its whole-matrix exchange (planner/optimizer.py).
MXFP8 (planner/mx.py) prices the linears its auto rule converts (on Blackwell only) at their MXFP8 cost.
Under every compute term lies the host's dispatch floor (planner/dispatch.py): a micro-batch's
forward takes at least (operators it issues) x `Gpu.op_overhead_s`, and so do its backward and
the optimizer update; it decides the step of small models only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from . import comm
from .context_comm import attention_seconds, cp_link
from .activations import is_checkpointed, software_policy
from .compute import (block_forward_seconds, blocks_forward_flops_per_token, executed_attention_share,
                      fused_attention_seconds, head_forward_flops_per_token, head_forward_seconds,
                      loss_seconds, recomputed_forward_flops_per_token, regather_cover_seconds, step_flops)
from .dispatch import OPTIMIZER_OPS, stage_ops
from .dp_comm import data_parallel
from .hardware import Gpu
from .memory import compute_bytes
from .moe import (all_to_all_seconds, overlapped_all_to_all, pairs_overlap, routed_rows, routing_statistics_bytes,
                  sparse_mlp_flops_per_token)
from .mx import block_saving_seconds
from .optimizer import OptimizerStep, matrix_parameters, optimizer_step, whole_matrices
from .pipeline_p2p import p2p_seconds
from .makespan import makespan as schedule_makespan
from .workload import Strategy, Workload, rank_chunks, rank_parameters, stage_layers



@dataclass(frozen=True)
class StepTime:
    forward_s: float  # one micro-batch on the slowest stage, incl. tp communication
    backward_s: float
    pipeline_s: float  # makespan of all micro-batches (includes the bubble)
    bubble_s: float
    tp_comm_s: float  # per step, on the critical path
    recompute_s: float  # per step on the critical stage: forward work redone by checkpointing
    pp_comm_s: float  # per step on the critical stage: pipeline sends/receives
    dp_comm_s: float  # total data-parallel / ZeRO traffic time per step
    dp_exposed_s: float  # the part not hidden behind compute
    optimizer_s: float
    total_s: float
    simulated: bool  # pipeline makespan from the schedule simulator
    ep_comm_s: float = 0.0  # per step on the critical stage: expert-parallel all-to-all (dispatch, combine)
    ep_overlapped_s: float = 0.0  # per step: all-to-all hidden behind the paired chunk's compute (planner/moe.py)
    cp_comm_s: float = 0.0  # per step on the critical stage: context-parallel attention communication, exposed
    cp_overlapped_s: float = 0.0  # per step: the ring's transfers hidden behind its block attention
    # a whole-matrix optimizer (Muon, planner/optimizer.py), inside optimizer_s: the busiest owner's Newton-Schulz
    # seconds, the exchange's seconds and its bytes per step summed over the critical stage's ranks
    optimizer_newton_schulz_s: float = 0.0
    optimizer_exchange_s: float = 0.0
    optimizer_exchange_bytes: float = 0.0
    # per step: the compute slowed by the data-parallel / ZeRO collectives that run beside it (`overlap_interference`)
    overlap_slowdown_s: float = 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        if not (self.cp_comm_s or self.cp_overlapped_s):  # layouts without cp: the fields they always had
            del out["cp_comm_s"], out["cp_overlapped_s"]
        if not (self.optimizer_newton_schulz_s or self.optimizer_exchange_bytes):  # additive: whole-matrix only
            del out["optimizer_newton_schulz_s"], out["optimizer_exchange_s"], out["optimizer_exchange_bytes"]
        return out


# ------------------------------------------------------------------ the pipeline


def _simulator():
    """The schedule simulator, when the pipeline package provides it."""
    try:
        from ..schedules.registry import build_schedule
        from ..pipeline.simulate import Costs, simulate
    except ImportError:
        return None
    return build_schedule, Costs, simulate


SIMULATE_MAX_ACTIONS = 512  # above this, the closed form (exact for uniform stages) is used


@lru_cache(maxsize=1024)
def _schedule(schedule: str, p: int, m: int, v: int):
    """The schedule's actions, built once per (name, p, m, v): they do not depend on the costs."""
    return _simulator()[0](schedule, p, m, v)


@lru_cache(maxsize=4096)
def _simulated_makespan(schedule: str, p: int, m: int, v: int, f: float, b_input: float, b_weight: float) -> float:
    s = _schedule(schedule, p, m, v)
    # the simulator's makespan (pipeline/simulate.py) from the schedule's graph, built once (planner/makespan.py)
    return schedule_makespan(s, f / s.virtual, b_input / s.virtual, b_weight / s.virtual)  # per chunk


def closed_form_makespan(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Makespan of m micro-batches over p stages; f, b per micro-batch per stage (all its chunks)."""
    steady = m * (f + b)
    if p == 1:
        return steady
    from ..schedules.registry import SCHEDULES
    kind = SCHEDULES[schedule]
    if kind.bubble_time is not None:  # the registration's bubble for general F, I, W (interleaved, zb-h1)
        return steady + kind.bubble_time(p, m, v, f, b, w)
    if kind.placement == "v":  # the registration's bubble share (F = I = W)
        return steady / (1 - kind.bubble(p, m, v))
    return steady + (p - 1) * (f + b)


def simulates(schedule: str, p: int, m: int, v: int) -> bool:
    """Whether `pipeline_makespan` runs the simulator (small pipelines) rather than the closed forms."""
    from ..schedules.registry import SCHEDULES
    v = v if SCHEDULES[schedule].needs_virtual_stages else 1
    chunks = SCHEDULES[schedule].chunks_for(v)
    return p > 1 and _simulator() is not None and 3 * p * m * chunks <= SIMULATE_MAX_ACTIONS


def pipeline_makespan(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> tuple[float, bool]:
    """(makespan, whether the simulator computed it)."""
    from ..schedules.registry import SCHEDULES
    v = v if SCHEDULES[schedule].needs_virtual_stages else 1
    if simulates(schedule, p, m, v):
        return _simulated_makespan(schedule, p, m, v, f, b - w, w), True
    return closed_form_makespan(schedule, p, m, v, f, b, w), False


# ------------------------------------------------------------------ one step


def _sparse_layers(w: Workload, st: Strategy, stage: int) -> int:
    return sum(w.model.is_moe_block(i) for c in rank_chunks(w.model, st.pp, stage, st.chunks, st.placement) for i in c.layers)


def _stage_compute(w: Workload, st: Strategy, gpu: Gpu, stage: int) -> tuple[float, float, float, float]:
    """(forward, backward, weight-gradient part of backward, recomputation part of backward) compute
    seconds of one micro-batch. A sparse block's MLP is whole on every tp rank: without sequence
    parallelism each tp rank computes it for all its tokens (planner/moe.py)."""
    m, s = w.model, w.seq_len
    layers = stage_layers(m, st.pp, st.chunks, st.placement)[stage]
    sparse = _sparse_layers(w, st, stage)
    tokens = st.micro_batch_size(w) * st.local_seq(w)  # this rank's: 1/cp of each sequence, keys over all of it
    share = executed_attention_share(w.attention)  # what the attention kernel really computes
    fwd = blocks_forward_flops_per_token(m, s, layers, sparse, share)
    chunks = rank_chunks(m, st.pp, stage, st.chunks, st.placement)
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)
    if last:
        fwd += head_forward_flops_per_token(m)
    policy = software_policy(st.remat, w.selective, st.precision)  # another software's selective (workload.SELECTIVE)
    recompute = recomputed_forward_flops_per_token(m, s, policy, layers, st.remat_every, share, sparse)
    # the blocks' rate from the shapes of a dense block's matmuls on this tp rank (compute.py); a sparse
    # block's MLP FLOPs run at that rate too
    mb = st.micro_batch_size(w)
    block_s, block_flops = block_forward_seconds(m, mb, s, st.tp, st.sequence_parallel, w.attention, gpu,
                                                 st.precision, st.cp, w.elementwise)
    if st.precision in ("fp8", "mxfp8") and layers:  # the first and last block stay bf16 (fp8_skip_first_last)
        kept = min(layers, int(first) + int(last))
        bf16_s, _ = block_forward_seconds(m, mb, s, st.tp, st.sequence_parallel, w.attention, gpu, "bf16", st.cp,
                                          w.elementwise)
        if st.precision == "mxfp8":  # the linears the auto rule converts, at their MXFP8 cost (planner/mx.py)
            block_s = bf16_s - block_saving_seconds(m, tokens, st.tp, gpu) / gpu.compute_efficiency
        block_s = (kept * bf16_s + (layers - kept) * block_s) / layers
    rate = block_flops / block_s
    head = head_forward_flops_per_token(m) if last else 0.0
    replicated = sparse * sparse_mlp_flops_per_token(m, s) if st.tp > 1 and not st.sequence_parallel else 0.0
    f = tokens * ((fwd - head - replicated) / st.tp + replicated) / rate
    if last:
        f += head_forward_seconds(m, mb, st.local_seq(w), st.tp, gpu, st.precision)
    per_flop = f / (tokens * fwd)  # seconds per counted FLOP of this stage
    b = tokens * (2 * fwd + recompute) * per_flop
    redo = tokens * recompute * per_flop
    if last:  # the cross-entropy's passes over the logits (memory-bound, the software's own kernels)
        loss_f, loss_b = loss_seconds(m, mb, st.local_seq(w), st.tp, gpu, st.precision, w.loss)
        f, b = f + loss_f, b + loss_b
    # the host's floor (planner/dispatch.py): small kernels wait for their dispatch
    ops_f, ops_b = stage_ops(m, layers, sparse, m.experts // st.ep if m.experts else 0, first, last)
    ops_b += ops_f * (recompute / fwd if fwd else 0.0)
    op = gpu.op_overhead_s
    return max(f, ops_f * op), max(b, ops_b * op), max(f, ops_b * op / 2), redo


def _ep_comm(w: Workload, st: Strategy, gpu: Gpu, stage: int) -> tuple[float, float]:
    """Expert-parallel all-to-all seconds of one micro-batch's (forward, backward) on a stage: dispatch
    and combine per sparse block, again for a recomputed forward."""
    sparse = _sparse_layers(w, st, stage)
    if st.ep == 1 or not sparse:
        return 0.0, 0.0
    # the rank's own tokens: under cp its 1/cp part of each sequence (it routes only those)
    rows = routed_rows(w.model, st.micro_batch_size(w), st.local_seq(w), st.tp, st.sequence_parallel)
    one = all_to_all_seconds(rows, w.model, compute_bytes(st.precision), st.ep, st.tp, gpu)
    redo = {"full": 1.0, "every-k": 1 / max(1, st.remat_every)}.get(st.remat, 0.0)
    return 2 * sparse * one, (2 + 2 * redo) * sparse * one


def _tp_comm(w: Workload, st: Strategy, gpu: Gpu, layers: float, stage: int = 0) -> tuple[float, float]:
    """Tensor-parallel seconds of one micro-batch's (forward, backward) on the critical path of a stage."""
    if st.tp == 1:
        return 0.0, 0.0
    nbytes = compute_bytes(st.precision) * st.micro_batch_size(w) * st.local_seq(w) * w.model.hidden
    link = comm.axis_link(gpu, "tp", st.tp, st.dp, st.tp)
    one = comm.ring_all_reduce(nbytes, st.tp, link)
    backward_count = 2 + (2 if st.remat == "full" else 0)
    if st.remat == "every-k":
        backward_count += 2 / max(1, st.remat_every)
    regather = 0.0
    if st.sequence_parallel:  # each region's linears all-gather their saved shard again (parallel/tensor.py)
        regather = layers * _regather_exposed(w, st, gpu, comm.all_gather(nbytes, st.tp, link), stage)
    return 2 * layers * one, backward_count * layers * one + regather


def _regather_exposed(w: Workload, st: Strategy, gpu: Gpu, gather_s: float, stage: int) -> float:
    """A block's two regathers less the backward work they run under (compute.py `regather_cover_seconds`):
    the region's backward where the block kept its shard, the first consumer's input gradient where the
    block is checkpointed or offloaded (its shard recomputed or reloaded). Software that issues the
    regather inside its linear's backward (Megatron-LM, `Workload.regather`) hides it under that GEMM."""
    if w.regather == "exposed":
        return 2 * gather_s
    cp = (st.cp,) if st.cp > 1 else ()
    cover = regather_cover_seconds(w.model, st.micro_batch_size(w), w.seq_len, st.tp, w.attention, gpu,
                                   st.precision, *cp)
    if w.regather == "linear":
        return sum(max(0.0, gather_s - c) for c in cover["linear"])
    region, consumer = cover["region"], cover["consumer"]
    blocks = [i for c in rank_chunks(w.model, st.pp, stage, st.chunks, st.placement) for i in c.layers]
    redone = sum(1 for i in blocks if is_checkpointed(i, st.remat, st.remat_every) or i in st.act_offload)
    share = redone / len(blocks) if blocks else 0.0
    return sum((1 - share) * max(0.0, gather_s - r) + share * max(0.0, gather_s - c)
               for r, c in zip(region, consumer))


def _cp_comm(w: Workload, st: Strategy, gpu: Gpu, layers: int, sparse: int = 0) -> tuple[float, float, float]:
    """Context-parallel seconds of one micro-batch on a stage: (forward, backward) on the critical path and
    the ring's transfers hidden behind its block attention. Every block's attention sends the figures of
    planner/context_comm.py once in forward and once in backward, and its forward ones again when the
    backward recomputes the core (full, every-k's checkpointed blocks, selective). Each of the `sparse`
    blocks (a mixture of experts) also all-reduces its routing statistics over cp in forward (identity
    backward; again when the block is recomputed: full, every-k), exposed."""
    if st.cp == 1 or not layers:
        return 0.0, 0.0, 0.0
    m = w.model
    mb = st.micro_batch_size(w)
    heads, kv_heads = m.heads // st.tp, max(1, m.kv_heads // st.tp)
    # the call's attention compute (forward), what hides the ring's hops: its FLOPs at the kernel's rate
    attention_s = fused_attention_seconds(m, mb * st.local_seq(w), w.seq_len, st.tp, w.attention, gpu,
                                          st.precision) / gpu.compute_efficiency
    call = attention_seconds(st.cp_method, st.cp, mb, heads, kv_heads, st.local_seq(w), m.head_dim,
                             compute_bytes(st.precision), cp_link(gpu, st.tp, st.cp), attention_s)
    redo = {"full": 1.0, "selective": 1.0, "every-k": 1 / max(1, st.remat_every)}.get(st.remat, 0.0)
    hidden = layers * ((1 + redo) * call.forward_hidden + call.backward_hidden)
    stats = 0.0
    if sparse:  # parallel/expert.py AxisSequenceShards.sum: one small all-reduce per sparse block
        stats = comm.all_reduce(routing_statistics_bytes(m, mb), st.cp, cp_link(gpu, st.tp, st.cp))
    block_redo = {"full": 1.0, "every-k": 1 / max(1, st.remat_every)}.get(st.remat, 0.0)  # the whole block again
    return (layers * call.forward + sparse * stats,
            layers * (redo * call.forward + call.backward) + block_redo * sparse * stats, hidden)


def _critical_stage(w: Workload, st: Strategy, gpu: Gpu) -> tuple:
    """The pipeline rank whose micro-batch takes longest (of the embedding's, the most blocks', the head's) with
    its parts: (forward + backward, stage, f, b, wgrad, fwd, bwd, tp, redo, p2p, ep, hidden, cp_comm, cp_hidden)."""
    best = None
    per_rank = stage_layers(w.model, st.pp, st.chunks, st.placement)
    heaviest = max(range(st.pp), key=lambda r: per_rank[r])
    for stage in sorted({0, heaviest, st.pp - 1}):  # the embedding, the most blocks, the head
        f, b, wgrad, redo = _stage_compute(w, st, gpu, stage)
        layers = per_rank[stage]
        sparse = _sparse_layers(w, st, stage)
        tp_f, tp_b = _tp_comm(w, st, gpu, layers - 0.5 * sparse, stage)  # a replicated MoE: no MLP all-reduce
        ep_f, ep_b = _ep_comm(w, st, gpu, stage)
        hidden = 0.0
        overlap = (w.a2a_overlap if w.a2a_overlap is not None
                   else pairs_overlap(st.schedule, st.ep, st.tp, st.zero, st.remat, False))
        if overlap and st.pp > 1:  # the schedule's overlapped pairs hide part of it (planner/moe.py)
            ep_f, ep_b, hidden = overlapped_all_to_all(st.schedule, st.pp, st.microbatches, stage, f, b, ep_f, ep_b)
        p2p_f, p2p_b = p2p_seconds(w, st, gpu)
        fwd, bwd = f + tp_f + ep_f + p2p_f, b + tp_b + ep_b + p2p_b
        cp_f, cp_b, cp_hidden = _cp_comm(w, st, gpu, layers, sparse)
        if st.cp > 1:
            fwd, bwd = fwd + cp_f, bwd + cp_b
        candidate = (fwd + bwd, stage, f, b, wgrad, fwd, bwd, tp_f + tp_b, redo, p2p_f + p2p_b, ep_f + ep_b, hidden,
                     cp_f + cp_b, cp_hidden)
        best = candidate if best is None or candidate[0] > best[0] else best
    return best


def makespan_floor(p: int, m: int, chunks: int, f: float, b: float) -> float:
    """A floor under any simulated makespan: the last rank's first action is a forward of a stage >= p - 1, which
    waits for the p - 1 stages before it (f / chunks each), and then the rank runs its whole m (f + b)."""
    return (p - 1) * (f / chunks) + m * (f + b)


BOUND_SLACK = 1e-9  # a layout is dropped only when its lower bound exceeds the bound by more than rounding


def step_time(w: Workload, st: Strategy, gpu: Gpu, bound: float | None = None) -> StepTime | None:
    """The step's time and its parts. With `bound` (seconds): None, without simulating the pipeline, when the step
    provably takes longer (`makespan_floor`; the search's pruning, search.py). Only a simulated pipeline is pruned:
    the closed forms cost nothing to evaluate."""
    _, stage, f, b, wgrad, fwd, bwd, tp, redo, p2p, ep, hidden, cp_comm, cp_hidden = _critical_stage(w, st, gpu)
    v = st.virtual
    dp_total, dp_exposed = data_parallel(w, st, gpu, stage, b, f)
    opt = _optimizer_step(w, st, gpu, stage)
    interference = overlap_interference(dp_total - dp_exposed, gpu)
    rest = dp_exposed + interference + opt.total_s
    if (bound is not None and simulates(st.schedule, st.pp, st.microbatches, v)
            and (makespan_floor(st.pp, st.microbatches, st.chunks, fwd, bwd) + rest) * (1 - BOUND_SLACK) > bound):
        return None
    makespan, simulated = pipeline_makespan(st.schedule, st.pp, st.microbatches, v, fwd, bwd, wgrad)
    bubble = makespan - st.microbatches * (fwd + bwd)
    total = makespan + dp_exposed + interference + opt.total_s
    m = st.microbatches
    return StepTime(fwd, bwd, makespan, bubble, m * tp, m * redo, m * p2p, dp_total, dp_exposed, opt.total_s, total,
                    simulated, m * ep, m * hidden, m * cp_comm, m * cp_hidden, opt.newton_schulz_s, opt.exchange_s,
                    opt.exchange_bytes, interference)


def overlap_interference(hidden_s: float, gpu: Gpu) -> float:
    """Seconds a step's compute grows by while `hidden_s` seconds of collectives run beside it: NCCL's kernels hold
    multiprocessors and HBM bandwidth, so compute overlapped by a collective runs `Gpu.overlap_slowdown` slower
    (Lee et al. 2025, hardware.py): in `hidden_s` of wall time it does hidden_s / (1 + d) of its work, and the rest
    takes hidden_s d / (1 + d) more. Where a collective outlasts its compute the overlapped compute is slowed all
    the same (first order: its exposed part is not shortened)."""
    d = gpu.overlap_slowdown
    return max(0.0, hidden_s) * d / (1 + d)


def _optimizer_step(w: Workload, st: Strategy, gpu: Gpu, stage: int) -> OptimizerStep:
    """The optimizer's step on pipeline rank `stage`: its update over the rank's local parameters and, for a
    whole-matrix optimizer (Muon), the stage's Newton-Schulz work and exchange (planner/optimizer.py)."""
    count = rank_parameters(w.model, st.tp, st.pp, stage, st.chunks, st.ep, st.placement)
    shard = st.replicas if st.zero >= 1 else 1
    local = (count.trainable - count.expert) / shard + count.expert / (st.expert_replicas if st.zero >= 1 else 1)
    blocks = tuple(i for c in rank_chunks(w.model, st.pp, stage, st.chunks, st.placement) for i in c.layers)
    matrix = matrix_parameters(w.model, len(blocks), st.tp) / shard if whole_matrices(w.optimizer) else 0.0
    return optimizer_step(w.optimizer, w.model, blocks, local, matrix, st.dp, st.tp, st.zero, gpu, OPTIMIZER_OPS)


def hardware_tflops_per_gpu(w: Workload, st: Strategy, seconds: float) -> float:
    """FLOP/s per GPU including recomputation, in TFLOP/s (what Megatron-LM papers report)."""
    return step_flops(w, st, hardware=True) / (seconds * st.world_size) / 1e12
