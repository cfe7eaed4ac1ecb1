"""A mixture of experts (models/moe.py) in the planner: parameters, FLOPs, saved bytes, all-to-all.

A sparse block replaces the dense MLP (gate?, up, down of `ffn_hidden`) by a router
(hidden x experts), `experts` stacked expert MLPs of `expert_ffn_hidden` (no biases) and an
optional shared MLP of `shared_experts x expert_ffn_hidden`. A token uses `experts_top_k` of
the routed experts: `workload.active_parameters` counts only those (embeddings and head included, as
the published "active" figures do).

Placement (parallel/expert.py, docs/moe.md): a sparse block is whole on every tp rank (router,
experts, shared experts; the attention splits as usual), its experts split over `ep` (carved out
of dp): a rank holds experts / ep of them, whose gradients are reduced (and ZeRO-sharded) over
edp = dp / ep ranks; the dense parameters over all of dp.

Work per token of a sparse block's MLP: the router 2*h*E, each kept assignment 2 x (the expert's
weights) and the shared experts 2 x theirs; the assignments a token keeps are k (dropless) or,
with a capacity factor c, at most E * ceil(c s k / E) per sequence of s. Without sequence
parallelism every tp rank routes and computes all of its tokens (the block is replicated); with
it, its own s / tp of them. Expert parallelism does not change a rank's expert work when the load is
balanced (it receives from the ep group as many rows as it sends); it adds four all-to-alls per
sparse block and micro-batch (dispatch and combine, forward and backward; two more when the block's
forward is recomputed), each moving the rows bound for other ranks: (ep - 1) / ep of the rank's
kept assignments x h x the compute dtype's bytes.

Saved bytes (what autograd keeps, counted against `SavedTensorMeter` on the CPU) of one sparse
block's MLP for T tokens, A kept assignments, c bytes per element, beyond its input (the norm's
output, counted with the block): the router's probabilities and logits 8*T*E, top-k indices
8*T*k (k > 1: the top-k values and their sum 4*T*(k + 1)), the per-sequence balance f_e 4*b*E,
the z-loss log-sum-exp 4*T; the gathered rows c*A*h with their index 8*A, the experts' gate,
silu, up and product 4c*A*f (GELU: up, gelu 2c*A*f), the gate weights c*A with their index 8*A,
the combined rows c*A*h, the scaled rows c*A*h and the index of the sum 8*A; under ep the
arrived rows are regrouped by expert and back (two more int64 indices, 16*A); shared experts
save as a dense MLP of their width. Under context parallelism (dropless) T and A are the rank's own:
its 1/cp part of every sequence is what it routes, so every item is 1/cp of the whole sequence's but
the per-sequence balance, which sums its parts over cp (`AxisSequenceShards`; over tp too under
sequence parallelism, with or without cp) and then saves the summed mean probability for its
gradient as well: 8*b*E. The all-to-all rows under ep are the local
ones. The load is assumed balanced (each rank receives A rows); a rank whose experts are more
popular holds more.

Overlap of the all-to-all (`Workload.a2a_overlap`, `overlapped_all_to_all`): software that runs a
paired forward and backward of two different chunks at once (DeepSeek-V3's DualPipe: "overlap the
computation and communication within a pair of individual forward and backward chunks", DeepSeek-AI
2024, arXiv:2412.19437, section 3.2.1) hides one chunk's all-to-all behind the other chunk's compute.
For the schedules whose registration names such pairs (`ScheduleKind.pairs`: dualpipev), a pair costs
each side's all-to-all hidden behind the other side's compute, so what stays exposed of it is
    max(0, a2a(F chunk) - compute(B other chunk)) + max(0, a2a(B other chunk) - compute(F chunk));
the forwards and backwards outside the pairs (warm-up, the zero-bubble rounds, cool-down) keep their
all-to-all fully exposed. threefold's own runtime runs the pairs that way (pipeline/expert_overlap.py:
the two sides take turns at each exchange) where `pairs_overlap` holds.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ..config import ModelConfig
from . import comm


def _mats(m: ModelConfig) -> int:
    return 3 if m.mlp == "swiglu" else 2


def dense_mlp_parameters(m: ModelConfig, width: int) -> int:
    b = 1 if m.bias else 0
    return _mats(m) * m.hidden * width + b * ((_mats(m) - 1) * width + m.hidden)


def expert_parameters(m: ModelConfig) -> int:
    """One routed expert's weights."""
    return _mats(m) * m.hidden * m.expert_width


def shared_parameters(m: ModelConfig) -> int:
    return dense_mlp_parameters(m, m.shared_experts * m.expert_width) if m.shared_experts else 0


def sparse_block_extra(m: ModelConfig) -> int:
    """Parameters a sparse block has beyond a dense block of the same model."""
    return (m.hidden * m.experts + m.experts * expert_parameters(m) + shared_parameters(m)
            - dense_mlp_parameters(m, m.ffn_hidden))


def sparse_blocks(m: ModelConfig) -> int:
    return sum(m.is_moe_block(i) for i in range(m.layers))


def dense_mlp_rank(m: ModelConfig, tp: int) -> float:
    """A dense block's MLP on one tp rank (column/row-parallel matrices split, the down bias whole)."""
    b = 1 if m.bias else 0
    return (dense_mlp_parameters(m, m.ffn_hidden) - b * m.hidden) / tp + b * m.hidden


def sparse_block_rank_extra(m: ModelConfig, tp: int, ep: int) -> tuple[float, float]:
    """(parameters a sparse block has on a rank beyond a dense block's, of which routed-expert weights)."""
    experts = m.experts // ep * expert_parameters(m)
    return m.hidden * m.experts + experts + shared_parameters(m) - dense_mlp_rank(m, tp), float(experts)


# ------------------------------------------------------------------ work


def kept_per_token(m: ModelConfig, seq: int) -> float:
    """Expert assignments a token keeps: k dropless, fewer when the capacity per sequence binds."""
    if m.expert_capacity <= 0:
        return float(m.experts_top_k)
    capacity = math.ceil(m.expert_capacity * seq * m.experts_top_k / m.experts)
    return min(float(m.experts_top_k), m.experts * capacity / seq)


def dense_mlp_flops_per_token(m: ModelConfig) -> float:
    return 2 * _mats(m) * m.hidden * m.ffn_hidden


def sparse_mlp_flops_per_token(m: ModelConfig, seq: int) -> float:
    """Forward FLOPs of a sparse block's MLP per token: router, kept experts, shared experts."""
    shared = 2 * _mats(m) * m.hidden * m.shared_experts * m.expert_width
    return 2 * m.hidden * m.experts + kept_per_token(m, seq) * 2 * expert_parameters(m) + shared


def routed_rows(m: ModelConfig, b: int, s: int, tp: int, sp: bool) -> float:
    """Kept assignments (rows sent to experts) of one rank for b sequences of s tokens."""
    tokens = b * s / (tp if sp and tp > 1 else 1)
    return tokens * kept_per_token(m, s)


# ------------------------------------------------------------------ saved bytes


def sparse_mlp_saved_bytes(m: ModelConfig, b: int, s: int, c: int, tp: int = 1, sp: bool = False,
                           ep: int = 1, cp: int = 1) -> float:
    """Bytes a sparse block's MLP saves for backward (module docstring), its input excluded; `s` is the
    rank's tokens of a sequence (under context parallelism its 1/cp part: the router routes only those)."""
    tokens = b * s / (tp if sp and tp > 1 else 1)
    e, k, h = m.experts, m.experts_top_k, m.hidden
    a = routed_rows(m, b, s, tp, sp)
    summed = cp > 1 or (sp and tp > 1)  # the statistics summed over the holders of the sequence's parts
    balance = 4 * b * e * (2 if summed else 1)  # f_e; summed, P_e is saved for its gradient too
    router = 8 * tokens * e + 8 * tokens * k + (4 * tokens * (k + 1) if k > 1 else 0) + balance + 4 * tokens
    act = 4 if m.mlp == "swiglu" else 2
    dispatch = c * a * h + 8 * a + act * c * a * m.expert_width + c * a + 8 * a + 2 * c * a * h + 8 * a
    if ep > 1:
        dispatch += 16 * a
    offsets = 4 * (e // ep)  # the grouped matmul's int32 row offsets, one per local expert (models/moe.py)
    shared = act * c * tokens * m.shared_experts * m.expert_width
    return router + dispatch + offsets + shared


def routing_statistics_bytes(m: ModelConfig, b: int) -> float:
    """Bytes a sparse block all-reduces over the ranks holding the parts of its b sequences (context
    parallelism; models/moe.py `MoE._auxiliary`): per sequence and expert the assignments and summed
    probabilities, per sequence the z-loss sum, per expert the count, and the dropped count (fp32)."""
    return 4 * (2 * b * m.experts + b + m.experts + 1)


# ------------------------------------------------------------------ all-to-all


def all_to_all_seconds(rows: float, m: ModelConfig, c: int, ep: int, tp: int, gpu) -> float:
    """One all-to-all over the ep group of `rows` (kept assignments of a rank) x h x c bytes, balanced:
    (ep - 1) / ep of them leave the rank, those for ranks in the same node over NVLink, the others
    over the rank's network port (the two run at once); one latency per peer."""
    if ep <= 1:
        return 0.0
    nbytes = rows * m.hidden * c * (ep - 1) / ep
    local = max(1, min(ep, gpu.gpus_per_node // max(1, tp)))  # ep ranks sharing a node (stride tp)
    remote = ep - local
    intra, inter = comm.intra_link(gpu), comm.inter_link(gpu)
    t_intra = nbytes * (local - 1) / (ep - 1) / intra.bytes_per_s + (local - 1) * intra.latency_s
    t_inter = nbytes * remote / (ep - 1) / inter.bytes_per_s + remote * inter.latency_s if remote else 0.0
    return max(t_intra, t_inter)


@lru_cache(maxsize=1024)
def overlapped_pairs(schedule: str, p: int, m: int, rank: int) -> int:
    """How many (forward, backward) pairs of different chunks `rank` runs overlapped (0: none)."""
    from ..schedules.registry import SCHEDULES  # pure Python: the registry the runtime reads

    kind = SCHEDULES[schedule]
    if p <= 1 or kind.pairs is None or kind.check(p, m, 1):
        return 0
    return len(kind.pairs(p, m, rank))


def pairs_overlap(schedule: str, ep: int, tp: int, zero: int, remat: str, compiled: bool) -> bool:
    """Whether threefold's runtime overlaps the expert all-to-all in `schedule`'s pairs: a schedule that
    names pairs (dualpipev), ep > 1, and none of what keeps a pair's sides from taking turns
    (`schedules.registry.pair_overlap_blockers`: tp > 1, ZeRO-3, activation checkpointing, compile)."""
    from ..schedules.registry import SCHEDULES, pair_overlap_blockers

    return (ep > 1 and SCHEDULES[schedule].pairs is not None
            and not pair_overlap_blockers(tp, zero, remat, compiled))


def overlapped_all_to_all(schedule: str, p: int, m: int, rank: int, compute_f: float, compute_b: float,
                          a2a_f: float, a2a_b: float) -> tuple[float, float, float]:
    """(forward, backward, hidden) all-to-all seconds per micro-batch of a rank, on average over its m
    micro-batches, when its schedule's pairs overlap one chunk's all-to-all with the other chunk's
    compute (module docstring). `compute_*` and `a2a_*` are one micro-batch's, all chunks together; a
    pair holds one chunk's forward and the other chunk's backward (1/chunks of each). In a pair the
    forward's all-to-all is on the wire while the backward computes and the backward's while the
    forward computes (pipeline/expert_overlap.py: the sides take turns at each exchange), so per pair
        exposed = max(0, a2a(F) - compute(B)) + max(0, a2a(B) - compute(F))."""
    pairs = overlapped_pairs(schedule, p, m, rank)
    if not pairs or a2a_f + a2a_b <= 0:
        return a2a_f, a2a_b, 0.0
    from ..schedules.registry import SCHEDULES

    chunks = SCHEDULES[schedule].chunks_for(1)
    share = pairs / chunks / m  # of a micro-batch's forward (and backward) that runs in pairs, on average
    hidden_f, hidden_b = share * min(a2a_f, compute_b), share * min(a2a_b, compute_f)
    return a2a_f - hidden_f, a2a_b - hidden_b, hidden_f + hidden_b
