"""Memory per rank: model states by ZeRO stage and precision, activations, buffers, margin.

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3: K = 12 bytes of optimizer state
per parameter under mixed precision): per parameter the rank holds
    params  2 bytes (bf16/fp16 compute copy)  or 4 (fp32 training)
    grads   2 bytes                           or 4
    optim  12 bytes (fp32 master, Adam m, v)  or 8 (Adam m, v; the fp32 params are the master)
ZeRO over N data-parallel ranks shards optim (stage >= 1), grads (>= 2) and params (3):
16P, 4P + 12P/N, 2P + 14P/N and 16P/N bytes under mixed precision. Frozen parameters (the
GPT key bias) have no gradient and no optimizer state. Under context parallelism the parameters
are replicated over cp as over dp: ZeRO shards over the replica ranks dp x cp (docs/context.md).

Activations: the itemised bytes of activations.py (each tensor autograd saves, as the models
really save them) for every micro-batch a rank holds at its peak. Without a pipeline that is one
micro-batch (each backward frees its activations before the next forward). With one, the rank's
own list of actions in the schedule (schedules.registry.compute_orders: the lists the runtime
executes) is replayed: a forward adds its chunk's bytes, a full backward (B) or the weight half
(W, which zb-h1 defers) frees them, the input half (I) frees nothing; the peak of that sum is
what the rank holds (interleaved chunks, GPipe's m, zb-h1's deferred weight gradients included).
With activation offload (`remat.offload=cpu`) the offloaded blocks' saves leave that sum and are
`activations_host` instead (activations.py `offload_split`), held from their forward until their
backward starts (B or I: the input half already brings them back), replayed the same way; on a GPU
the backward holds two offloaded blocks on the device again (the one running and the one prefetched),
a transient.

On a GPU the peak also holds what the meter never sees: the working set of the block being
recomputed, the logits' gradient and the loss's fp32 chunk, communication buffers (gradient
buckets, ZeRO-3 gathered layers, pipeline send/recv), plus ALLOCATOR_MARGIN of fragmentation
and RESERVED_BYTES for the CUDA context, cuBLAS workspaces and NCCL. On the CPU (gloo runs)
none of these are added: the prediction is the counted bytes of the trainer's `mem` record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from ..config import Config, TrainConfig
from ..optim.registry import entry as optimizer_entry
from ..models.loss_pieces import chunk_rows
from .activations import (Shape, block_bytes, blocks_bytes, embedding_bytes, head_bytes, loss_in_pieces,
                          loss_piece_tokens, offload_split, offloaded_block_bytes, software_policy)
from .hardware import CPU, GiB, Gpu
from .mx import cast_transient_bytes
from .optimizer import matrix_parameters, muon_transient_bytes, state_bytes_per_param, whole_matrices
from .workload import Chunk, ParamCount, Strategy, Workload, from_config, rank_chunks, rank_parameters

ALLOCATOR_MARGIN = 0.10  # caching-allocator fragmentation, as a fraction of the bytes in use
RESERVED_BYTES = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL internal buffers


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, all micro-batches in flight
    transient: float = 0.0  # recomputed block, logits work space (GPU only)
    buffers: float = 0.0  # communication buffers (GPU only)
    margin: float = 0.0  # allocator margin + reserved (GPU only)
    stage: int = 0  # the pipeline stage whose rank needs the most
    activations_host: float = 0.0  # remat.offload=cpu: saved activations held in host memory (not in total)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.transient + self.buffers + self.margin

    def as_dict(self) -> dict:
        out = {k: int(round(v)) for k, v in asdict(self).items() if k != "stage"}
        if not self.activations_host:
            del out["activations_host"]
        out["total"] = int(round(self.total))
        out["peak"] = out["total"]
        return out


# ------------------------------------------------------------------ model states


def bytes_per_param(precision: str, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter before any ZeRO sharding: the optimizer's states from
    optim/registry.py (a hidden matrix's under Muon), plus its fp32 master under 16-bit compute."""
    return optimizer_entry(optimizer).bytes_per_param(TrainConfig(optimizer=optimizer), precision)


def model_state_bytes(count: ParamCount, precision: str, zero: int, dp: int, ep: int = 1, optimizer: str = "adamw",
                      matrix: float = 0.0) -> tuple[float, float, float]:
    """Bytes of parameters, gradients and optimizer states on one rank (ZeRO over dp ranks; routed
    experts' over the dp / ep ranks holding the same experts). `matrix`: how many of the rank's trainable
    parameters are hidden matrices, whose states a whole-matrix optimizer (Muon) keeps apart from the rest's
    (planner/optimizer.py)."""
    p_bytes, g_bytes, _ = bytes_per_param(precision, optimizer)
    o_matrix, o_rest = (state_bytes_per_param(optimizer, precision, True),
                        state_bytes_per_param(optimizer, precision, False))
    edp = dp // ep
    dense, dense_trainable, expert = count.total - count.expert, count.trainable - count.expert, count.expert
    params = dense * p_bytes / (dp if zero >= 3 else 1) + expert * p_bytes / (edp if zero >= 3 else 1)
    grads = dense_trainable * g_bytes / (dp if zero >= 2 else 1) + expert * g_bytes / (edp if zero >= 2 else 1)
    dense_states = matrix * o_matrix + (dense_trainable - matrix) * o_rest
    optim = dense_states / (dp if zero >= 1 else 1) + expert * o_rest / (edp if zero >= 1 else 1)
    return params, grads, optim


OUTER_BYTES_PER_PARAM = 8  # DiLoCo: fp32 outer parameters and outer momentum (parallel/local_sgd.py)


def slow_link_state_bytes(count: ParamCount, st: Strategy, dp_intra: int) -> float:
    """State the slow-link options keep beyond the model states: DiLoCo's outer parameters and momentum;
    hpZ's secondary weight partition (compute dtype, sharded over the dp ranks of a node)."""
    extra = OUTER_BYTES_PER_PARAM * count.trainable if st.sync_every > 1 and st.outer == "nesterov" else 0.0
    if st.hpz and st.zero >= 3:
        extra += count.total * compute_bytes(st.precision) / max(1, dp_intra)
    return extra


# ------------------------------------------------------------------ activations


def compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def micro_shape(w: Workload, st: Strategy) -> Shape:
    """One micro-batch on one rank: its sequences' local part (1/cp of each under context parallelism)."""
    if st.cp > 1:
        return Shape(st.micro_batch_size(w), st.local_seq(w), compute_bytes(st.precision), st.tp,
                     st.sequence_parallel and st.tp > 1, st.cp, st.cp_method)
    return Shape(st.micro_batch_size(w), w.seq_len, compute_bytes(st.precision), st.tp,
                 st.sequence_parallel and st.tp > 1)


def chunk_bytes(w: Workload, st: Strategy, chunk: Chunk, rows_seen: bool = False) -> float:
    """Bytes one micro-batch's forward through `chunk` saves (one meter window)."""
    policy = software_policy(st.remat, w.selective, st.precision)
    return _chunk_bytes(w, micro_shape(w, st), w.global_batch // st.dp, chunk, policy, st.remat_every, st.ep,
                        st.act_offload, rows_seen)


@lru_cache(maxsize=65536)  # the search asks again for every zero stage and schedule of a shape
def _chunk_bytes(w: Workload, x: Shape, rows: int, chunk: Chunk, remat: str, every: int, ep: int,
                 act_offload: tuple[int, ...], rows_seen: bool) -> float:
    m, hf = w.model, w.implementation == "hf-llama"
    if act_offload:
        total = offload_split(m, x, chunk.layers, remat, every, hf, ep, act_offload)[0]
    else:
        total = blocks_bytes(m, x, chunk.layers, remat, every, hf, ep)
    if chunk.first:
        total += embedding_bytes(m, x, rows, hf)
    if chunk.last:
        total += head_bytes(m, x, rows, with_rows=not (chunk.first or rows_seen), hf=hf)
    return total


def held_states(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches held per chunk after each forward of `rank` (the states where peaks occur),
    keeping only states no other state dominates."""
    return _held_states_of_every_rank(schedule, p, steady_microbatches(schedule, p, m, v), v)[rank]


@lru_cache(maxsize=1024)
def steady_microbatches(schedule: str, p: int, m: int, v: int) -> int:
    """A smaller micro-batch count whose held states equal those of `m`, or `m` itself.

    Past its warm-up a schedule repeats a steady pattern, so the states where peaks occur stop
    changing with m (gpipe's do not: it holds every micro-batch). That is checked, not assumed: the
    count `base` and `base + p` (same remainder modulo p, so the schedule's checks agree) must give
    the same states; otherwise the whole `m` is computed."""
    from ..schedules import registry as schedules

    base = 4 * p * max(v, 2) + m % p
    if m <= base + p or schedules.check(schedule, p, base, v) or schedules.check(schedule, p, base + p, v):
        return m
    same = _held_states_of_every_rank(schedule, p, base, v) == _held_states_of_every_rank(schedule, p, base + p, v)
    return base if same else m


@lru_cache(maxsize=1024)
def _held_states_of_every_rank(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`held_states` of every rank from one computation of the orders (they are made together)."""
    from ..schedules import registry as schedules  # the lists the runtime runs (pure Python)

    per_rank = []
    for order in schedules.compute_orders(schedule, p, m, v):  # the registry's order function
        counts, states, rising = [0] * schedules.chunks_per_rank(schedule, v), set(), False
        for a in order:
            chunk = a.stage // p
            if a.kind == "F":
                counts[chunk] += 1
                rising = True
            elif a.kind in ("B", "W"):
                if rising:  # a state just before a release; those within a run of forwards are dominated
                    states.add(tuple(counts))
                    rising = False
                counts[chunk] -= 1
        if rising:
            states.add(tuple(counts))
        per_rank.append(_undominated(states))
    return tuple(per_rank)


def _undominated(states: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The states no other state dominates (at least as many in every chunk), largest first."""
    kept: list[tuple[int, ...]] = []
    for s in sorted(states, reverse=True):  # whatever dominates s comes before it, or is dominated by a kept one
        if not any(all(x >= y for x, y in zip(k, s)) for k in kept):
            kept.append(s)
    return tuple(kept)


def peak_activations(w: Workload, st: Strategy, rank: int) -> float:
    """Activation bytes pipeline rank `rank` holds at its peak."""
    v = st.chunks
    chunks = rank_chunks(w.model, st.pp, rank, v, st.placement)
    per = [chunk_bytes(w, st, c) for c in chunks]
    if st.pp == 1:
        return per[0]
    states = held_states(st.schedule, st.pp, st.microbatches, v, rank)
    return max(sum(n * b for n, b in zip(counts, per)) for counts in states)


def chunk_host_bytes(w: Workload, st: Strategy, chunk: Chunk) -> float:
    """Bytes one micro-batch's forward through `chunk` leaves in host memory (activation offload)."""
    x, hf = micro_shape(w, st), w.implementation == "hf-llama"
    return offload_split(w.model, x, chunk.layers, st.remat, st.remat_every, hf, st.ep, st.act_offload)[1]


@lru_cache(maxsize=4096)
def host_held_states(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches whose offloaded saves are in host memory, per chunk, after each forward of `rank`:
    as `held_states`, except that the input half of a split backward (I) already brings them back."""
    from ..schedules import registry as schedules

    order = schedules.compute_orders(schedule, p, m, v)[rank]
    counts, states = [0] * schedules.chunks_per_rank(schedule, v), set()
    for a in order:
        chunk = a.stage // p
        if a.kind == "F":
            counts[chunk] += 1
            states.add(tuple(counts))
        elif a.kind in ("B", "I"):
            counts[chunk] -= 1
    return tuple(sorted(states, reverse=True))


def peak_host_activations(w: Workload, st: Strategy, rank: int) -> float:
    """Offloaded activation bytes pipeline rank `rank` holds in host memory at its peak (0 without offload)."""
    if not st.act_offload:
        return 0.0
    chunks = rank_chunks(w.model, st.pp, rank, st.chunks, st.placement)
    per = [chunk_host_bytes(w, st, c) for c in chunks]
    if st.pp == 1:
        return per[0]
    states = host_held_states(st.schedule, st.pp, st.microbatches, st.chunks, rank)
    return max(sum(n * b for n, b in zip(counts, per)) for counts in states)


def in_flight(st: Strategy, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak (all chunks together)."""
    if st.pp == 1:
        return 1
    return max(sum(counts) for counts in held_states(st.schedule, st.pp, st.microbatches, st.chunks, stage))


# ------------------------------------------------------------------ the whole rank


def stage_memory(w: Workload, st: Strategy, stage: int, gpu: Gpu = CPU) -> MemoryBreakdown:
    """Memory of a rank at pipeline coordinate `stage`."""
    count = rank_parameters(w.model, st.tp, st.pp, stage, st.chunks, st.ep, st.placement)
    blocks = tuple(i for c in rank_chunks(w.model, st.pp, stage, st.chunks, st.placement) for i in c.layers)
    matrix = matrix_parameters(w.model, len(blocks), st.tp) if whole_matrices(w.optimizer) else 0.0
    params, grads, optim = model_state_bytes(count, st.precision, st.zero, st.replicas, st.ep, w.optimizer,
                                             matrix)  # ZeRO over dp+cp
    optim += slow_link_state_bytes(count, st, dp_per_node(st, gpu))
    if w.sharding == "fsdp2" and st.pp > 1 and st.zero >= 2:
        grads = 4.0 * count.trainable  # the stage's unsharded fp32 accumulators (workload.SHARDING)
    # what ZeRO, hpZ and the buckets do not change, once per shape (the search asks for each zero stage)
    acts, host, transient, buffers, layers = _stage_working_set(w, replace(st, zero=0, hpz=False, bucket_mb=0.0),
                                                                stage, gpu is CPU)
    if gpu is CPU:
        return MemoryBreakdown(params, grads, optim, acts, stage=stage, activations_host=host)
    if st.precision == "mxfp8":  # the largest converted GEMM's cast operands (planner/mx.py)
        transient += cast_transient_bytes(w.model, st.micro_batch_size(w) * st.local_seq(w), st.tp, gpu)
    if matrix:  # Muon's step runs after the backward freed the activations (planner/optimizer.py)
        local = matrix / (st.replicas if st.zero >= 1 else 1)
        transient = max(transient, muon_transient_bytes(w.model, blocks, st.dp, st.tp, local) - acts)
    if st.replicas > 1:
        # buckets in flight while the next ones fill (no more than the rank's whole gradients: a bucket
        # larger than them is one collective over all of them)
        buffers += 2 * min(st.bucket_mb * 2**20, bytes_per_param(st.precision)[1] * count.trainable)
    if st.zero >= 3:
        per_layer = count.total / max(1, layers)
        buffers += 2 * per_layer * compute_bytes(st.precision) * 2  # gathered layer in use + the one prefetched, with grads
        if w.sharding == "fsdp2":
            buffers += 4 * per_layer  # the unit's gradients cast to fp32 for the reduce-scatter
    used = params + grads + optim + acts + transient + buffers
    return MemoryBreakdown(params, grads, optim, acts, transient, buffers, ALLOCATOR_MARGIN * used + RESERVED_BYTES,
                           stage=stage, activations_host=host)


@lru_cache(maxsize=65536)
def _stage_working_set(w: Workload, st: Strategy, stage: int, counted_only: bool) -> tuple[float, ...]:
    """A rank's activations (device, host), transients and pipeline buffers, and its block count."""
    acts = peak_activations(w, st, stage)
    host = peak_host_activations(w, st, stage)
    if counted_only:
        return acts, host, 0.0, 0.0, 0
    x = micro_shape(w, st)
    chunks = rank_chunks(w.model, st.pp, stage, st.chunks, st.placement)
    layers = sum(len(c.layers) for c in chunks)
    hf = w.implementation == "hf-llama"
    transient = 0.0
    sparse = bool(w.model.experts) and any(w.model.is_moe_block(i) for c in chunks for i in c.layers)
    if st.remat in ("full", "every-k") and layers:
        transient += block_bytes(w.model, x, "none", hf, sparse, st.ep)  # the block being recomputed
    elif st.remat == "selective" and layers:
        policy = software_policy(st.remat, w.selective, st.precision)
        transient += block_bytes(w.model, x, "none", hf) - block_bytes(w.model, x, policy, hf)
    moved = [i for c in chunks for i in c.layers if i in st.act_offload] if st.act_offload else []
    if moved:  # brought back for the backward: the block running and the one prefetched behind it
        biggest = max(offloaded_block_bytes(w.model, x, i, st.remat, st.remat_every, hf, st.ep) for i in moved)
        transient += min(2, len(moved)) * biggest
    if any(c.last for c in chunks):
        # the logits' gradient (and, in pieces, the piece's recomputed logits) in the compute dtype, and
        # the cross-entropy's fp32 chunk (models/cross_entropy.py: its softmax overwrites the chunk in place,
        # 4 bytes a logit, while softmax - one_hot is written during the forward; 8 is the tp loss's copy and exp)
        # (transformers' own loss, hf-llama: the logits, their fp32 copy and its gradient)
        tokens, vocab = loss_piece_tokens(w.model, x), w.model.padded_vocab / st.tp
        if hf:
            transient += (x.c + 8) * tokens * vocab
        elif w.loss == "torch":  # F.cross_entropy of fp32 logits, whole: the saved fp32 log-softmax, its gradient
            # and the gradient it writes, 12 bytes a logit at the backward's peak, less what head_bytes counted
            saved = 0 if loss_in_pieces(w.model, x) else x.c * x.bs * vocab
            transient += 12 * x.bs * vocab - saved
        else:
            transient += ((2 if loss_in_pieces(w.model, x) else 1) * x.c * tokens * vocab
                          + 8 * chunk_rows(int(tokens), int(vocab), int(x.c)) * vocab)
    if st.cp > 1 and layers:
        transient += context_transient(w.model, x)
    buffers = 2 * x.c * x.bs * w.model.hidden / (st.tp if x.sp else 1) if st.pp > 1 else 0.0  # send and receive
    return acts, host, transient, buffers, layers


def context_transient(m, x: Shape) -> float:
    """What a context-parallel attention holds while it runs, beyond what it saves (one layer at a time):
    the ring's second K,V block (the one in flight) and, in backward, the two fp32 dK,dV accumulators
    (the one being added to and the one arriving); allgather's gradients of the gathered K,V (the whole
    sequence, in the compute dtype, before the reduce-scatter); ulysses' head-sharded copies are the size
    of the local q, k, v (counted by the block)."""
    kv = 2 * x.b * max(1, m.kv_heads // x.t) * x.s * m.head_dim  # elements of one rank's K and V
    if x.cp_method == "ring":
        return kv * x.c + 2 * kv * 4
    if x.cp_method == "allgather":
        return x.cp * kv * x.c
    return 0.0


def dp_per_node(st: Strategy, gpu: Gpu) -> int:
    """dp ranks inside one node (the mesh puts tp innermost, then dp): dp_intra of the node axes."""
    return max(1, min(st.dp, gpu.gpus_per_node // st.tp))


def rank_memory(w: Workload, st: Strategy, gpu: Gpu = CPU) -> MemoryBreakdown:
    """The breakdown of the pipeline rank that needs the most memory."""
    stages = range(st.pp) if st.pp <= 4 else sorted({0, 1, st.pp - 2, st.pp - 1})
    return max((stage_memory(w, st, s, gpu) for s in stages), key=lambda mem: mem.total)


def predict_memory(cfg: Config, world_size: int, gpu: Gpu | None = None, rank: int | None = None) -> dict:
    """Predicted bytes for a threefold run of `cfg` on `world_size` processes: of global rank
    `rank`, or of the rank that needs the most (rank=None).

    Keys as in metrics.jsonl `mem` (params, grads, optimizer, activations, peak) plus the
    planner's extras. On the CPU (`gpu=None`) the prediction is what the trainer counts: no
    allocator margin, no buffers, and the configured precision (`auto`: fp32 on the CPU, bf16 on a GPU).
    """
    w, st = from_config(cfg, world_size, "cpu" if gpu is None else "cuda")
    if rank is None:
        return rank_memory(w, st, gpu or CPU).as_dict()
    return stage_memory(w, st, rank // (st.dp * st.cp * st.tp), gpu or CPU).as_dict()  # mesh order pp, dp, cp, tp


# ------------------------------------------------------------------ the paper's formula


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            policy: str = "none") -> float:
    """Activation bytes per transformer layer in Megatron-LM, Korthikanti et al. 2022, table 2
    (16-bit activations, 1-byte dropout masks, s x s attention scores kept)."""
    sbh = s * b * h
    if policy == "full":
        return 2 * sbh / (t if sp else 1)
    score = 0 if policy == "selective" else 5 * a * s / h
    if sp:
        return sbh * (34 + score) / t
    return sbh * (10 + 24 / t + score / t)
