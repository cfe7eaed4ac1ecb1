"""ZeRO stages 1-3 against plain data parallelism (gloo, CPU): parameters, bytes sent, bytes held."""

import math


from tests.helpers import make_config, rel_err
from tests.zero_tasks import (assemble, overlapped_gather, pooled_buckets, train_stages, zero2_unused_parameter,
                              zero3_gathers_in_place, zero3_lanes)
from threefold.comm import ring_chunk
from threefold.models.decoder import build_model

# AdamW eps=1e-6: see test_data_parallel.py. grad_clip=0.5 is active: the global norms are
# about 0.8, so clipping by the global norm is exercised.
BASE = ["model.preset=tiny", "model.layers=4", "train.steps=20", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
        "train.eps=1e-6", "train.grad_clip=0.5"]
# A model whose parameters do not split evenly over 4 ranks: shards and buckets are padded.
UNEVEN = ["model.hidden=30", "model.heads=3", "model.kv_heads=3", "model.ffn_hidden=50", "model.vocab=251",
          "model.layers=4"]
ELT = 4  # fp32


def sizes(overrides: list[str], n: int) -> dict:
    """Element counts the byte formulas need, from the model itself."""
    model = build_model(make_config(overrides, "unused").model, seed=0)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    g = sum(p.numel() for p in trainable)
    return {"G": g, "G_bucket": -(-g // n) * n,  # one bucket (25 MB), padded to a multiple of n
            "W3": sum(n * -(-p.numel() // n) for p in params),  # stage 3: every parameter padded
            "G3": sum(n * -(-p.numel() // n) for p in trainable)}


def check_stages(worlds, tmp_path, n: int, extra: list[str], micro: int, segment_min_bytes: int | None = None):
    overrides = BASE + extra + [f"train.microbatches={micro}"]
    runs = [overrides + [f"parallel.zero={z}"] for z in range(4)]
    reports = worlds(n).run(train_stages, runs, str(tmp_path), segment_min_bytes)  # reports[rank][stage]
    dp = assemble([r[0]["params"] for r in reports], [r[0]["placements"] for r in reports])
    assert any(norm > 0.5 for norm in reports[0][0]["norms"]), "clipping never active: the test would not cover it"
    for stage in (1, 2, 3):
        got = assemble([r[stage]["params"] for r in reports], [r[stage]["placements"] for r in reports])
        assert got.keys() == dp.keys()
        for name in dp:
            assert not got[name].isnan().any(), f"stage {stage}: {name} not fully covered by the placements"
            err = rel_err(got[name], dp[name])
            assert err <= 1e-5, f"n={n} stage {stage}: {name} differs from plain DP by {err:.2e}"
        for a, b in zip(reports[0][stage]["losses"], reports[0][0]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
    # bytes sent per rank per step over dp, exactly (ring volumes; see comm/collectives.py)
    s = sizes(overrides, n)
    for rank, r in enumerate(reports):
        for stage, report in enumerate(r):
            for step, comm in enumerate(report["comm"]):
                dp_bytes = comm["dp"]
                if stage == 0:
                    assert dp_bytes["all_reduce"] == 2 * (s["G"] - ring_chunk(s["G"], n, rank)) * ELT
                    continue
                rs, ag = dp_bytes["reduce_scatter"], dp_bytes.get("all_gather", 0)
                per_pass = {1: 1, 2: micro, 3: micro}[stage]
                if stage in (1, 2):  # a step's parameter gathers are issued by the next step's forward
                    assert rs == per_pass * (n - 1) * s["G_bucket"] // n * ELT
                    assert ag == (n - 1) * s["G_bucket"] // n * ELT if step > 0 else ag == 0
                else:
                    assert rs == micro * (n - 1) * s["G3"] // n * ELT
                    assert ag == micro * 2 * (n - 1) * s["W3"] // n * ELT
                assert "all_reduce" not in dp_bytes  # only tagged scalars (norm, metrics) are all-reduced
    # stages 1 and 2 move what plain DP moves: 2 (n-1)/n of the gradient bytes, up to bucket padding
    dp_total = sum(r[0]["comm"][0]["dp"]["all_reduce"] for r in reports)
    for stage in (1, 2):
        total = sum(c["dp"]["reduce_scatter"] + c["dp"]["all_gather"] for r in reports for c in r[stage]["comm"][1:2])
        if micro == 1 or stage == 1:
            assert total == dp_total + 2 * (n - 1) * (s["G_bucket"] - s["G"]) * ELT
    # stage 3: peak whole parameters are the running unit and the prefetched one, plus the embedding
    # while tied to the head (it stays whole between its two uses)
    r3 = reports[0][3]
    units = r3["units"]
    tied = sum(units[u] for u in r3["tied_units"])
    blocks = sorted((v for k, v in units.items() if k not in r3["tied_units"]), reverse=True)
    bound = tied + blocks[0] + blocks[1]
    assert all(r[3]["peak_whole"] <= bound for r in reports), (r3["peak_whole"], bound, units)
    assert bound < 0.75 * sum(units.values())
    return reports


def test_zero_stages_match_dp_on_2_ranks_with_accumulation(worlds, tmp_path):
    """ZeRO-1/2's buckets cut into 4 segments (reduce-scattered and all-gathered one by one, the
    gathers overlapping the next forward): same parameters and bytes as plain DP."""
    reports = check_stages(worlds, tmp_path, 2, [], micro=2, segment_min_bytes=0)
    assert reports[0][1]["segments"] == reports[0][2]["segments"] == [4]


def test_zero_param_gather_overlaps_the_next_forward(worlds, tmp_path):
    """After the step the all-gathers are due, not done; the first module's forward waits for one
    segment only, the others are still in flight; every gather is done when the run returns."""
    r = worlds(2).run(overlapped_gather, BASE + ["train.steps=3", "parallel.zero=1"], str(tmp_path))[0]
    assert r["segments"] == [4] and r["due_after_step"] and r["left"] == 0
    first, waiting = r["in_flight"][0]
    assert first.startswith("embed") and waiting == 3, r["in_flight"]


def test_zero2_buckets_share_a_pool_allocated_once_per_step(worlds, tmp_path):
    """Many small buckets and 2 micro-batches: the buckets fill 2 pooled buffers in turn (each
    allocated once per step, not once per bucket and pass; a buffer is reused only after its
    reduce-scatter was waited for: the parameters still equal plain DP's), and between steps a
    rank holds only its gradient shards."""
    overrides = BASE + ["train.steps=3", "train.microbatches=2", "parallel.bucket_mb=0.05"]
    r = worlds(2).run(pooled_buckets, overrides, str(tmp_path))[0]
    assert r["buckets"] >= 4, r["buckets"]
    for step in r["steps"]:
        assert step["buffers"] == r["pool_size"] == 2 and step["filled"] == 2, step
        assert step["allocations"] == step["buffers"], step  # not buckets x micro-batches
        assert step["grads"] == r["shard_bytes"], step
    for name, value in r["dp"].items():
        err = rel_err(r["zero2"][name], value)
        assert err <= 1e-5, f"{name} differs from plain DP by {err:.2e}"


def test_zero2_pooled_buckets_zero_what_no_gradient_reached(worlds):
    """Rank 1 never uses the last block: over 2 micro-batches its pooled buffers (reused, not
    zeroed) still contribute zeros there, and the shards equal plain DP's sums."""
    for r in worlds(2).run(zero2_unused_parameter):
        assert r["buckets"] > r["pool"]
        err = rel_err(r["got"], r["expected"])
        assert err <= 1e-6, f"ZeRO-2 shard differs from plain DP's sum by {err:.2e}"


def test_zero_stages_match_dp_on_4_ranks_uneven_shapes(worlds, tmp_path):
    reports = check_stages(worlds, tmp_path, 4, UNEVEN, micro=1)
    s = sizes(BASE + UNEVEN, 4)
    assert s["G"] % 4 and s["W3"] > sum(math.prod(p.global_shape) for p in reports[0][0]["placements"].values())


def test_zero3_gathers_straight_into_the_parameters(worlds, tmp_path):
    """No staging buffer: each all-gather writes into the whole parameters' own storage, and no copy
    ever writes a whole parameter (parity with plain DP: the tests above)."""
    r = worlds(2).run(zero3_gathers_in_place, BASE + ["train.steps=2", "parallel.zero=3"], str(tmp_path))[0]
    assert r["outputs"] and all(r["outputs"]), r["outputs"]
    assert r["copies"] == 0


def test_zero3_gathers_on_the_gather_lane_and_reduce_scatters_on_dp(worlds, tmp_path):
    """Every parameter all-gather (prefetched or not, 8-bit too) is handed to torch.distributed on
    the Mesh's second dp group (`gather` lane), every gradient reduce-scatter on dp itself; the
    records name the lane and file the bytes under dp."""
    base = BASE + ["train.steps=2", "parallel.zero=3"]
    runs = [base, base + ["parallel.zero_weight_comm=int8"]]
    for run, r in zip(runs, worlds(2).run(zero3_lanes, runs, str(tmp_path))[0]):
        assert r["lane_ranks"] == r["dp_ranks"] == [0, 1]
        ops = {op for op, _ in r["calls"]}
        assert ops == {"all_gather", "reduce_scatter"}, (run, ops)
        assert set(r["calls"]) == {("all_gather", "gather"), ("reduce_scatter", "dp")}, (run, set(r["calls"]))
        model_traffic = {rec for rec in r["records"] if rec[0] in ("all_gather", "reduce_scatter")}
        assert model_traffic == {("all_gather", "dp", "gather"), ("reduce_scatter", "dp", "")}, (run, model_traffic)


def test_zero_composes_with_tensor_parallelism_and_checkpointing(worlds, tmp_path):
    """tp=2 x dp=2 with sequence parallelism and full recomputation: ZeRO 2 and 3 still equal plain DP."""
    overrides = BASE + ["train.steps=8", "parallel.tp=2", "parallel.sequence_parallel=true", "remat.policy=full"]
    reports = worlds(4).run(train_stages, [overrides + [f"parallel.zero={z}"] for z in (0, 2, 3)], str(tmp_path))
    dp = assemble([r[0]["params"] for r in reports], [r[0]["placements"] for r in reports])
    for i, stage in ((1, 2), (2, 3)):
        got = assemble([r[i]["params"] for r in reports], [r[i]["placements"] for r in reports])
        for name in dp:
            assert rel_err(got[name], dp[name]) <= 1e-5, (stage, name)


def test_nvme_offload_is_bitwise_the_in_memory_optimizer_and_resumes(worlds, tmp_path):
    """parallel.offload=nvme (several units per rank, read ahead by one) against no offload, ZeRO-1
    and ZeRO-3 on 2 ranks, 10 steps: the same losses and parameters, bit for bit; resumed from its
    step-5 checkpoint with and without offload, the same again (the scratch file is rebuilt).
    Under ZeRO-3 the parameter shards live in their scratch file too, at most 3 of the units'
    shards in memory at once (read twice per step at least: forward and backward)."""
    import torch

    from tests.zero_tasks import nvme_parity

    # two micro-batches: ZeRO-3's streamed gradients are read, added to and written back per micro-batch
    base = BASE[:1] + ["model.layers=4", "train.global_batch=4", "train.seq_len=16", "train.lr=1e-3", "train.eps=1e-6",
                       "train.grad_clip=0.5", "train.microbatches=2"]
    reports = worlds(2).run(nvme_parity, base, str(tmp_path))
    for rank, r in enumerate(reports):
        for stage in (1, 3):
            ref = r[f"z{stage}-none"]
            assert r[f"z{stage}-nvme"]["units"] > 2 and r[f"z{stage}-nvme"]["file"]
            assert r[f"z{stage}-nvme"]["scratch_metric"]  # mem.scratch: the bytes in the scratch files
            assert not r[f"z{stage}-left"], r[f"z{stage}-left"]
            if stage == 3:  # the parameter shards live in the scratch file between gathers
                home = r["z3-nvme"]["home"]
                assert home["units"] >= 7 and home["peak"] <= 3 and home["unlinked"], home
                assert home["read"] >= 2 * 10 * home["nbytes"] // 2 and home["size"] >= home["nbytes"] // 2, home
                grads = r["z3-nvme"]["grads"]  # the reduced gradients: in their file, none resident after a step
                assert grads["unlinked"] and grads["resident"] == 0 and grads["written"] > 0, grads
                # read per step: the second micro-batch's add, the norm's pass and the update's
                assert grads["read"] >= 3 * 10 * grads["nbytes"] // 2, grads
            for run in ("nvme", "resumed", "resumed-none"):
                got = r[f"z{stage}-{run}"]
                assert got["losses"] == ref["losses"][-len(got["losses"]):], f"rank {rank} ZeRO-{stage} {run}"
                assert len(got["losses"]) == (10 if run == "nvme" else 5)
                for name, p in ref["params"].items():
                    assert torch.equal(got["params"][name], p), f"rank {rank} ZeRO-{stage} {run}: {name}"
