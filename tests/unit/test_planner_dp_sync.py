"""Data-parallel sync as NCCL and the frameworks run it (issue 54, item 3; docs/planner.md "Data-parallel sync"):
NCCL's ring and tree over the dp group's nodes (planner/comm.py `Group`), gradient buckets by software
(planner/dp_comm.py `software_bucket_mb`), each bucket reduced as soon as its gradients are ready
(`bucket_tail`), and the runtime's 25 MiB default priced by the same model (planner/bucket_size.py)."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner import comm
from threefold.planner.bucket_size import best_bucket_mb, exposed_by_bucket
from threefold.planner.dp_comm import data_parallel, software_bucket_mb
from threefold.planner.hardware import PRESETS
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload

H100 = PRESETS["h100-80gb"]
NVLINK, NIC = H100.intra_bytes_per_s * H100.link_efficiency, H100.inter_bytes_per_s * H100.link_efficiency
A_INTRA, A_INTER = H100.intra_latency_s, H100.inter_latency_s


def llama7b(batch: int, seq: int = 4096) -> Workload:
    return Workload(load_config(None, ["model.preset=llama-7b"]).model, batch, seq)


def test_a_ring_across_nodes_pays_the_network_latency_only_where_it_crosses_a_node():
    """NCCL's tuning model (src/graph/tuning.cc): 64 ranks on 8 nodes (tp 1). An all-gather's 63 steps, 7 of
    them across nodes; an all-reduce's ring 126 steps, 16 across (nInterSteps = 2 nNodes), its tree a chain of
    7 in each node and 3 levels across, twice; one rank per node (tp 8) crosses on every step."""
    g = comm.group(H100, 1, 64)
    assert (g.ranks, g.per_node, g.nodes) == (64, 8, 8)
    assert comm.group_all_gather(0.0, g) == pytest.approx(56 * A_INTRA + 7 * A_INTER)
    ring, tree = 110 * A_INTRA + 16 * A_INTER, 2 * (7 * A_INTRA + 3 * A_INTER)
    assert comm.group_all_reduce(0.0, g) == pytest.approx(min(ring, tree))
    one_per_node = comm.group(H100, 8, 96)
    assert one_per_node.per_node == 1 and comm.group_reduce_scatter(0.0, one_per_node) == pytest.approx(95 * A_INTER)
    inside = comm.group(H100, 1, 8)  # one node: every step on NVLink
    assert inside.nodes == 1 and comm.group_all_gather(0.0, inside) == pytest.approx(7 * A_INTRA)


def test_a_group_crosses_nodes_through_the_nics_of_its_ranks_on_a_node():
    """Bytes on the intra- and inter-node links: of what a rank sends in a ring all-reduce, 2(n-1)/n B, one hop
    in 8 leaves the node (the ring goes through the node's 8 ranks), so a rank's NIC carries 1/8 of it and the
    group's bus bandwidth is 8 NICs (capped by NVLink); with one rank per node every byte crosses its one NIC."""
    nbytes = 2.0**30
    g = comm.group(H100, 1, 64)
    intra, inter = g.crossing_bytes("all_reduce", nbytes)
    sent = 2 * 63 / 64 * nbytes
    assert intra == pytest.approx(sent * 7 / 8) and inter == pytest.approx(sent / 8)
    assert g.bus_bytes_per_s == pytest.approx(min(NVLINK, 8 * NIC))
    one = comm.group(H100, 8, 64)
    assert one.crossing_bytes("all_reduce", nbytes) == pytest.approx((0.0, sent))
    assert one.bus_bytes_per_s == pytest.approx(NIC)
    # the bandwidth term of a 1 GiB all-gather: 8 NICs against one
    t8, t1 = (comm.group_all_gather(nbytes, x) - comm.group_all_gather(0.0, x) for x in (g, one))
    assert t8 == pytest.approx(63 / 64 * nbytes / min(NVLINK, 8 * NIC)) and t1 == pytest.approx(63 / 64 * nbytes / NIC)


def weak_scaling(dp: int, bucket_mb: float) -> float:
    """Seconds per step of llama-7b at tp 2 and ZeRO-1 (Megatron's distributed optimizer), two 4,096-token
    sequences per dp rank: a pure dp x tp layout whose batch grows with dp."""
    st = Strategy(dp=dp, tp=2, zero=1, microbatches=1, remat="selective", sequence_parallel=True, bucket_mb=bucket_mb)
    return step_time(llama7b(2 * dp), st, H100).total_s


def test_dp_96_192_288_with_megatron_core_buckets_moves_the_step_less_than_the_published_trend():
    """Issue 54: published dp x tp runs at dp 96 -> 192 -> 288 take 0.57 -> 0.64 s (+12%). With Megatron-Core's
    buckets (max(40M, 1M x dp) parameters) the model's step grows less than that; with a fixed 25 MiB every
    bucket's reduce-scatter ring pays its 287 steps' latency at dp 288 and the step more than doubles."""
    published = 0.64 / 0.57 - 1
    mcore = [weak_scaling(dp, software_bucket_mb("megatron-core", dp)) for dp in (96, 192, 288)]
    assert mcore[0] <= mcore[1] <= mcore[2] and mcore[2] / mcore[0] - 1 < published
    fixed = [weak_scaling(dp, 25.0) for dp in (96, 288)]
    assert fixed[1] / fixed[0] > 2.0
    assert software_bucket_mb("megatron-core", 288) == pytest.approx(288e6 * 2 / 2**20)
    assert software_bucket_mb("megatron-core", 8) == pytest.approx(40e6 * 2 / 2**20)
    assert software_bucket_mb("pytorch-ddp") == 25.0 and software_bucket_mb("deepspeed-pipe") == pytest.approx(
        500e6 * 2 / 2**20)


def test_a_bucket_ready_early_overlaps_the_remaining_backward():
    """dp 64 (8 nodes) without ZeRO: behind a long backward every bucket but the last is reduced while the
    backward still runs, so what is exposed is one bucket's collective; reduced after the backward (2021-22
    software, `grad_overlap=False`) all of it is."""
    w, st = llama7b(64), Strategy(dp=64, zero=0, microbatches=1, bucket_mb=25.0)
    total, exposed = data_parallel(w, st, H100, 0, backward_s=10.0, forward_s=5.0)
    grads = 2 * 6.74e9  # bf16 gradients of llama-7b's parameters
    buckets = round(grads / (25 * 2**20))
    assert exposed == pytest.approx(total / buckets, rel=0.02) and exposed < total / 100
    after = replace(w, grad_overlap=False)
    assert data_parallel(after, st, H100, 0, backward_s=10.0, forward_s=5.0) == pytest.approx((total, total))
    # a backward shorter than the collectives: the first bucket starts at B/n, the rest back to back
    _, short = data_parallel(w, st, H100, 0, backward_s=total / 2, forward_s=0.0)
    assert short == pytest.approx(total - total / 2 * (buckets - 1) / buckets, rel=1e-4)


def test_the_runtime_default_bucket_is_near_the_best_until_dp_makes_the_reduce_scatter_latency_bound():
    """The runtime's (and torch DDP's) 25 MiB, priced by the plan's model: llama-7b at dp 8 in one H100 node and
    at dp 64 over 8 nodes (all-reduce: NCCL's tree keeps the latency of a bucket at a few levels) it exposes
    within half a millisecond of the best size of 1-1000 MiB; at dp 288 x tp 2 under ZeRO-1 (a reduce-scatter
    ring of 287 steps per bucket) the best is 400 MiB or more, as Megatron-Core's dp-scaled bucket (576 MB there)."""
    for dp in (8, 64):
        exposed = exposed_by_bucket(llama7b(2 * dp), Strategy(dp=dp, zero=0, remat="selective"), H100)
        assert exposed[25.0] <= min(exposed.values()) + 5e-4, exposed
        assert exposed[25.0] < exposed[1.0] and exposed[25.0] < exposed[1000.0]
    st = Strategy(dp=288, tp=2, zero=1, remat="selective", sequence_parallel=True)
    assert best_bucket_mb(llama7b(576), st, H100) >= 400.0


def test_the_mpt_rows_at_512_h100_agree_with_their_communication_exposed_in_full():
    """The validation table's llm-foundry rows on 512 H100 that ran flash-attn 2 (tests/unit/test_planner_published.py;
    13b and 30b ran its Triton kernel and agree with their communication hidden): the model hides FSDP's gathers and
    reduce-scatters behind compute (slowing it by the published overlap_slowdown) and predicts 13-38% too fast; with
    every second of them exposed and nothing overlapped each is within 8% of the published throughput (docs/planner.md:
    a coincidence as far as the sources show, not a reason; within 5% while the gradients went in bf16 - their fp32
    reduce-scatter, Workload.grad_reduce, takes the 7b row to -6.9%)."""
    from tests.unit.test_planner_published import TRITON_ATTENTION
    from tests.unit.test_planner_validation import RUNS, error, predict

    rows = [run for run in RUNS if run[0].startswith("MPT") and run[0].endswith("512 H100")
            and run[0] not in TRITON_ATTENTION]
    assert len(rows) == 4
    for run in rows:
        value, best = predict(run)
        t = best.time
        serial = t.total_s - t.overlap_slowdown_s + t.dp_comm_s - t.dp_exposed_s
        full = (1 + error(run, value)) * t.total_s / serial - 1
        assert abs(full) <= 0.08 and error(run, value) > 0.12, (run[0], error(run, value), full)


def test_the_runtimes_hierarchical_all_reduce_sends_the_node_through_one_leader():
    """`compress.hierarchical` (comm/hierarchical.py): reduce in the node to its leader, all-reduce among the 8
    leaders, broadcast back. 1 GiB over 64 ranks on 8 nodes: the leaders' ring moves 2 x 7/8 GiB through one NIC
    per node, where NCCL's ring spreads it over the node's 8 NICs - so on these nodes it is the slower one."""
    nbytes = 2.0**30
    g = comm.group(H100, 1, 64)
    inside = 7 * A_INTRA + nbytes / NVLINK
    leaders = comm.group_all_reduce(nbytes, comm.Group(8, 1, g.intra, g.inter))
    assert leaders == pytest.approx(min(14 * A_INTER + 2 * 7 / 8 * nbytes / NIC, 6 * A_INTER + 2 * nbytes / NIC))
    assert comm.hierarchical_all_reduce(nbytes, g) == pytest.approx(2 * inside + leaders)
    assert comm.hierarchical_all_reduce(nbytes, g) > 3 * comm.group_all_reduce(nbytes, g)
    one_node = comm.group(H100, 1, 8)  # one node: the runtime all-reduces over dp_intra alone
    assert comm.hierarchical_all_reduce(nbytes, one_node) == comm.group_all_reduce(nbytes, one_node)
    # the plan of a run with it: its data-parallel seconds are the hierarchical collective's, bucket by bucket
    w, st = llama7b(64), Strategy(dp=64, zero=0, bucket_mb=25.0)
    flat, _ = data_parallel(w, st, H100, 0, backward_s=10.0, forward_s=5.0)
    hier, _ = data_parallel(w, replace(st, hierarchical=True), H100, 0, backward_s=10.0, forward_s=5.0)
    assert hier > 3 * flat


def test_a_run_configured_hierarchical_is_planned_so():
    from threefold.config import load_config as load
    from threefold.planner.workload import from_config

    cfg = load(None, ["model.preset=tiny", "compress.hierarchical=true", "parallel.dp=8"])
    assert from_config(cfg, 8, "cpu")[1].hierarchical
    assert not from_config(load(None, ["model.preset=tiny", "parallel.dp=8"]), 8, "cpu")[1].hierarchical


def test_fsdp2_under_a_pipeline_reduce_scatters_its_accumulated_gradients_once_a_step():
    """ZeRO-2 under a pipeline: threefold's runtime reduce-scatters each micro-batch's gradients (m collectives of
    the stage's gradients a step); PyTorch's FSDP2 under torch.distributed.pipelining accumulates them unsharded and
    reduce-scatters once, in the last micro-batch's backward (workload.SHARDING), as the memory model already holds
    (4 bytes a parameter of accumulators). The parameters are gathered once a step either way."""
    st = Strategy(dp=8, tp=8, pp=8, zero=2, microbatches=1, bucket_mb=25.0, sequence_parallel=True)
    ours, fsdp2 = llama7b(64), replace(llama7b(64), sharding="fsdp2")

    def total(w, m):
        return data_parallel(w, replace(st, microbatches=m), H100, 0, backward_s=1.0, forward_s=0.5)[0]

    rs = total(ours, 2) - total(ours, 1)  # one more micro-batch: one more reduce-scatter
    assert rs > 0 and total(ours, 8) == pytest.approx(total(ours, 1) + 7 * rs)
    assert total(fsdp2, 8) == pytest.approx(total(fsdp2, 1)) == pytest.approx(total(ours, 1))
