"""Data-parallel and ZeRO traffic of one step, and what of it is exposed (not hidden behind compute).

Gradients (in the precision's gradient bytes) are all-reduced bucket by bucket during the last
micro-batch's backward, each bucket once its gradients are ready (`bucket_tail`): the last bucket is
always exposed, and whatever the collectives cannot keep up with - unless the workload's
software reduces after the pipeline flush (`Workload.grad_overlap = False`: Megatron-LM and
DeepSpeed of 2021-22, below), where all of it is. ZeRO-1 reduce-scatters the same way and
all-gathers the updated parameters after the step: in threefold without pipeline or expert
parallelism these gathers overlap the next step's first forward (docs/zero.md, Megatron's
overlap_param_gather), otherwise they are exposed; ZeRO-2 must reduce-scatter after
every micro-batch (its gradients are sharded), each hidden behind that micro-batch's backward;
ZeRO-3 also all-gathers each layer's parameters before its forward and its backward (prefetched,
hidden behind compute when compute is longer).

Every collective here is NCCL's over the group's nodes (planner/comm.py `Group`: its ring crosses the network
only between nodes, its tree chains each node, a node's L ranks cross through L NICs), in the pieces the
software cuts it into (`software_bucket_mb`, ZeRO-3's `_units`); `Strategy.hierarchical` is the runtime's
compress.hierarchical (comm.hierarchical_all_reduce).

Context parallelism: the parameters are replicated over cp as over dp, so every gradient is reduced
(and ZeRO shards) over dp x cp ranks in one collective over the flattened dp+cp group (mesh.py
`replica_axis`, docs/context.md "In training"), whose ranks have stride tp.

Mixture of experts: the routed experts' gradients go over edp = dp / ep ranks (1/ep of their
bytes on each), the dense ones over dp; both on the same port, one after the other.

Slow links (planner/slow_links.py recommends them):
- `sync_every` H > 1 (local SGD / DiLoCo, parallel/local_sgd.py): no gradient crosses dp between
  meetings; a meeting is one fp32 all-reduce of the trainable parameters, not overlapped, so a step
  carries 1/H of it, exposed.
- ZeRO-3 `weight_comm` int8/fp8 and `grad_comm` int8 (comm/quantize.py, docs/zero.md): 1 byte per
  value plus one fp32 scale per 256, for the all-gathers and the reduce-scatter (an all-to-all and
  a local fp32 sum: the same bytes per rank as a reduce-scatter).
- hpZ: the backward all-gather reads a secondary partition sharded over the dp ranks of one node
  (ZeRO++, Wang et al. 2023), so it runs on NVLink among them (nothing to gather when a node holds
  one dp rank); the forward all-gather and the gradient reduce-scatter still cross the network.

Why `grad_overlap = False` for 2021-22 runs: DeepSpeed's pipeline engine issues ReduceTiedGrads,
ReduceGrads and OptimizerStep after the last micro-batch of its TrainSchedule
(deepspeed/runtime/pipe/schedule.py), and Megatron-LM's train_step of that time called the local
DDP's allreduce_gradients after forward_backward_func returned; overlapping the reduction with the
pipeline's last backward came with Megatron-core's `overlap_grad_reduce` (2023).
"""

from __future__ import annotations

import math

from . import comm
from .hardware import Gpu
from .memory import bytes_per_param, compute_bytes, dp_per_node
from .workload import Strategy, Workload, rank_chunks, rank_parameters

QUANTIZED_BYTES = 1 + 4 / 256  # an 8-bit value and its share of the block's fp32 scale
MEETING_BYTES = 4  # a local SGD / DiLoCo meeting all-reduces fp32 masters (or deltas)


def _groups(st: Strategy, gpu: Gpu, dense: float, expert: float) -> list[tuple[float, comm.Group]]:
    """(values, group) per reduction: dense over the replicas (dp, or dp x cp in one collective under context
    parallelism: ranks of stride tp, mesh.py `replica_axis`), experts (when any) over edp (x cp), the members
    of a dp group ep apart (mesh.py: ep inner), so 1/ep as many of them on a node."""
    replicas = comm.group(gpu, st.tp, st.replicas)
    if not expert:
        return [(dense, replicas)]
    per_node = max(1, min(st.expert_replicas, replicas.per_node // st.ep))
    experts = comm.Group(st.expert_replicas, per_node, replicas.intra, replicas.inter)
    return [(dense, replicas), (expert, experts)]


# Gradient buckets by software: the pieces its data-parallel gradient collectives go in, each paying its latency.
#   threefold       parallel.bucket_mb, 25 MiB (config/sections.py; parallel/buckets.py)
#   pytorch-ddp     25 MiB: torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25), torch/nn/parallel/distributed.py
#   megatron-core   max(40M, 1M x dp) parameters (megatron/core/distributed/distributed_data_parallel.py;
#                   distributed_data_parallel_config.py: "larger DP sizes need larger buckets to ensure collectives
#                   do not become latency-bound"), in the gradients' dtype (bf16: grad_reduce_in_fp32 off by default)
#   megatron-2021   one collective over the whole contiguous gradient buffer (megatron/model/distributed.py of
#                   2021-22: allreduce_gradients after forward_backward_func)
#   deepspeed-pipe  500M elements (deepspeed/runtime/constants.py MEMORY_OPT_ALLREDUCE_SIZE = 500000000)
#   fsdp            one reduce-scatter per wrapped unit (FullyShardedDataParallel / fully_shard): the
#                   ZeRO-3 pieces of `_units`, or a unit's gradient bytes where software wraps by block
ONE_BUFFER_MB = 2.0**30  # "one collective": a bucket larger than any rank's gradients
# DeepSpeed ZeRO's reduce_bucket_size default, elements (deepspeed/runtime/zero/config.py: 500,000,000)
DEEPSPEED_REDUCE_BUCKET = 500e6


def software_bucket_mb(software: str, dp: int = 0, grad_bytes: int = 2, default_mb: float = 25.0) -> float:
    """The gradient bucket, in MiB of gradients, that `software` reduces at data-parallel size `dp`."""
    if software in ("threefold", "pytorch-ddp"):
        return default_mb if software == "threefold" else 25.0
    if software == "megatron-core":
        return max(40e6, 1e6 * dp) * grad_bytes / 2**20
    if software == "megatron-2021":
        return ONE_BUFFER_MB
    if software == "deepspeed-pipe":
        return 500e6 * grad_bytes / 2**20
    raise ValueError(f"software_bucket_mb: unknown software '{software}'")


def _buckets(nbytes: float, st: Strategy) -> int:
    """Gradient buckets of `nbytes` (`bucket_mb` each; parallel/buckets.py): one collective each."""
    return max(1, math.ceil(nbytes / (st.bucket_mb * 2**20)))


def _in_buckets(collective, nbytes: float, st: Strategy, g: comm.Group) -> float:
    """`collective` of `nbytes` issued bucket by bucket."""
    return comm.in_pieces(collective, nbytes, _buckets(nbytes, st), g)


def _units(w: Workload, st: Strategy, stage: int) -> int:
    """ZeRO-3's units on a pipeline rank (parallel/units.py): one per block, the embedding on the first
    stage, the final norm and the head on the last; each is gathered and reduced by collectives of its own.
    DeepSpeed's ZeRO-3 of 2021 gathered each parameter tensor by a collective of its own (deepspeed/runtime/zero/
    partition_parameters.py `_all_gather`: `_allgather_param(param, async_op)` per parameter of the list), so
    there a block is `block_tensors` pieces (the final norm two, the embedding and head one each)."""
    chunks = rank_chunks(w.model, st.pp, stage, st.chunks, st.placement)
    per_block = block_tensors(w.model) if w.sharding == "deepspeed-2021" else 1
    return sum(len(c.layers) * per_block + int(c.first) + 2 * int(c.last) for c in chunks)


def block_tensors(m) -> int:
    """Parameter tensors of one dense block as Megatron-style GPT code holds them: the fused QKV and the output
    projection, two (GELU) or three (SwiGLU) MLP matrices, each with a bias when the model has biases, and two
    norms (LayerNorm: weight and bias; RMSNorm: weight)."""
    linears = 2 + (3 if m.mlp == "swiglu" else 2)
    return linears * (2 if m.bias else 1) + 2 * (2 if m.norm == "layernorm" else 1)


def data_parallel(w: Workload, st: Strategy, gpu: Gpu, stage: int, backward_s: float,
                  forward_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel / ZeRO communication in one step. Every collective pays
    its latency: the gradients go bucket by bucket, ZeRO-3 unit by unit (comm.in_pieces)."""
    if st.replicas == 1:
        return 0.0, 0.0
    count = rank_parameters(w.model, st.tp, st.pp, stage, st.chunks, st.ep, st.placement)
    _, grad_bytes, _ = bytes_per_param(st.precision)
    # the bytes a gradient takes on the wire: fp32 where the software reduces in fp32 (Workload.grad_reduce); the
    # buckets stay cut by the gradients' own bytes (the software fills them before the cast)
    reduce_bytes = 4 if w.grad_reduce == "fp32" else grad_bytes
    dense_trainable, expert = count.trainable - count.expert, count.expert
    trainable = _groups(st, gpu, dense_trainable, expert)
    if st.sync_every > 1:  # periodic meetings: nothing per step, one fp32 all-reduce every H steps
        t = sum(_in_buckets(comm.group_all_reduce, n * MEETING_BYTES, st, g) for n, g in trainable) / st.sync_every
        return t, t
    m = st.microbatches
    hide = backward_s if w.grad_overlap else 0.0
    buckets = sum(_buckets(n * grad_bytes, st) for n, _ in trainable)
    if st.zero == 0:  # NCCL's all-reduce, or the runtime's hierarchical one (compress.hierarchical)
        reduce = comm.hierarchical_all_reduce if st.hierarchical else comm.group_all_reduce
        t = sum(comm.in_pieces(reduce, n * reduce_bytes, _buckets(n * grad_bytes, st), g) for n, g in trainable)
        return t, bucket_tail(t, buckets, hide)
    wire_w = QUANTIZED_BYTES if st.weight_comm != "none" else compute_bytes(st.precision)
    wire_g = QUANTIZED_BYTES if st.grad_comm != "none" else reduce_bytes
    params = _groups(st, gpu, count.total - expert, expert)
    # ZeRO-1/2 reduce and gather back bucket by bucket (buckets of gradient bytes), ZeRO-3 unit by unit
    units = _units(w, st, stage) if st.zero >= 3 else 0

    def pieces(n: float) -> int:
        return units or _buckets(n * grad_bytes, st)

    def rs_pieces(n: float) -> int:  # DeepSpeed's ZeRO-3 reduced its gradients in buckets of reduce_bucket_size
        return math.ceil(n / DEEPSPEED_REDUCE_BUCKET) if units and w.sharding == "deepspeed-2021" else pieces(n)
    rs = sum(comm.in_pieces(comm.group_reduce_scatter, n * (wire_g if st.zero >= 3 else reduce_bytes), rs_pieces(n), g)
             for n, g in trainable)
    ag = sum(comm.in_pieces(comm.group_all_gather, n * (wire_w if st.zero >= 3 else compute_bytes(st.precision)),
                            pieces(n), g) for n, g in params)
    # the parameter all-gathers after the step overlap the next forward (threefold without pp or ep)
    ag_exposed = max(0.0, ag - forward_s) if w.grad_overlap and st.pp == 1 and st.ep == 1 else ag
    if st.zero <= 2:
        # reduce-scatters a step: ZeRO-1 one, in the last backward; ZeRO-2 one per micro-batch, but FSDP2 under a
        # pipeline accumulates the gradients unsharded (workload.SHARDING) and reduce-scatters them once, as ZeRO-1
        n = m if st.zero == 2 and not (w.sharding == "fsdp2" and st.pp > 1) else 1
        return n * rs + ag, n * bucket_tail(rs, buckets, hide) + ag_exposed
    # ZeRO-3: gather for forward and for backward, reduce-scatter in backward, every micro-batch
    ag_b = _hpz_gather(st, gpu, params, units) if st.hpz else ag
    if w.sharding == "deepspeed-2021":  # prefetch of 50M elements: less than one matrix ahead (_units)
        return m * (ag + ag_b + rs), m * (ag + ag_b + max(0.0, rs - backward_s))
    exposed = m * (max(0.0, ag - forward_s) + max(0.0, ag_b + rs - backward_s))
    return m * (ag + ag_b + rs), exposed


def bucket_tail(total_s: float, buckets: int, backward_s: float) -> float:
    """What of `total_s` of gradient collectives, `buckets` equal ones issued in order as each bucket's
    gradients are ready, outlasts a backward of `backward_s` (0: issued after it, all exposed).

    Gradients are ready at an even rate over the backward: bucket k of n at k/n of it (DDP and
    Megatron-Core launch a bucket when its last gradient arrives; parallel/buckets.py does the same). One
    collective runs at a time, c = total / n each, so bucket k ends at max over j <= k of (j/n B + (k - j + 1) c);
    the last ends at B + c when the collectives keep up (c <= B / n: only the last bucket is exposed) and at
    B / n + total when they do not. A larger bucket pays fewer latencies but leaves a larger last bucket
    exposed: the trade-off that sets the default size (`best_bucket_mb`)."""
    if backward_s <= 0.0:
        return total_s
    c = total_s / buckets
    return max(c, total_s - backward_s * (buckets - 1) / buckets)


def _hpz_gather(st: Strategy, gpu: Gpu, params: list[tuple[float, comm.Group]], units: int) -> float:
    """The backward all-gather from hpZ's secondary partition: over the dp ranks of a node, on NVLink,
    in the compute dtype (ZeRO++ keeps the secondary copy in 16 bits), unit by unit."""
    inside = dp_per_node(st, gpu)
    link = comm.intra_link(gpu)
    return sum(comm.in_pieces(comm.all_gather, n * compute_bytes(st.precision), units, min(g.ranks, inside), link)
               for n, g in params)
