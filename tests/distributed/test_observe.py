"""The debugging tools in 4-process gloo worlds: non-finite report, straggler, replica check,
collective fingerprint, per-rank statistics and traces."""

import json

import torch

from tests.helpers import train_and_report

QUICK = ["model.preset=tiny", "train.steps=4", "train.global_batch=8", "train.seq_len=16"]


def test_nan_in_one_rank_layer_is_named_with_rank_and_module(worlds, tmp_path):
    results = worlds(4).run(train_and_report, [
        *QUICK, "debug.nan_check=true", "debug.stats=true", "debug.replica_check_every=1",
        "debug.fingerprint_every=1", "debug.trace=true",
        "fault.kind=nan", "fault.rank=2", "fault.step=2", "fault.module=blocks.1.mlp.up"], str(tmp_path))
    for r in results:
        step2 = r["records"][1]
        assert step2["nonfinite"]["ranks"] == [2]
        assert step2["nonfinite"]["first"] == {"rank": 2, "module": "blocks.1.mlp.up"}
        assert step2["nonfinite"]["modules"] == {"2": "blocks.1.mlp.up"}
        assert step2["skipped"]  # the NaN reached the gradients: the optimizer step was skipped
        assert all("nonfinite" not in rec for i, rec in enumerate(r["records"]) if i != 1)
    report = json.loads((tmp_path / "observe" / "nonfinite.json").read_text())
    assert "first on rank 2 in module blocks.1.mlp.up" in report["message"]
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())
    assert summary["replica_checks"] == 4 and summary["fingerprint_checks"] == 4
    # per-rank figures of every step, and a trace per rank plus the merged one
    ranks = results[0]["records"][0]["ranks"]
    assert len(ranks["compute_s"]) == len(ranks["comm_s"]) == len(ranks["idle_s"]) == len(ranks["loss"]) == 4
    assert results[0]["records"][0]["comm"]["dp"]["all_gather.stats"] > 0
    events = json.loads((tmp_path / "trace" / "all.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert any(e["name"] == "all_reduce.metrics" for e in events)


def test_nan_origin_among_tensor_parallel_partners(worlds, tmp_path):
    # rank 3 makes its attention output NaN; its tp partner, rank 2, receives it through the next
    # row-parallel all-reduce, in a later module: the report orders them and names rank 3 first
    results = worlds(4).run(train_and_report, [
        *QUICK, "train.steps=2", "parallel.tp=2", "debug.nan_check=true",
        "fault.kind=nan", "fault.rank=3", "fault.step=2", "fault.module=blocks.0.attn.o"], str(tmp_path))
    event = results[0]["records"][1]["nonfinite"]
    assert event["first"] == {"rank": 3, "module": "blocks.0.attn.o"}
    assert event["ranks"] == [3, 2] and "first on rank 3 in module blocks.0.attn.o; then rank 2" in event["message"]


def test_slow_rank_is_flagged_as_the_straggler(worlds, tmp_path):
    results = worlds(4).run(train_and_report, [
        *QUICK, "debug.stats=true", "fault.kind=slow", "fault.rank=3", "fault.step=1", "fault.delay_s=0.3"],
        str(tmp_path))
    summary = json.loads((tmp_path / "observe" / "summary.json").read_text())["stats"]
    assert summary["straggler"] == 3, summary
    assert sum(rec["straggler"] == 3 for rec in results[0]["records"]) >= 2  # per step (a busy machine may blur one)
    # the others spent the slow rank's delay idle, waiting for it inside collectives
    idle = summary["median_per_rank"]["idle_s"]
    assert min(idle[:3]) >= 0.15 and idle[3] < 0.1, idle


def _mismatch_and_divergence():
    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.observe.fingerprint import CollectiveMismatch, Fingerprint
    from threefold.observe.replicas import ReplicaDivergence, check_replicas

    mesh = Mesh(Layout(dp=4), torch.device("cpu"))
    comm = Comm(mesh)
    fingerprint = Fingerprint(comm)
    rank = mesh.global_rank
    comm.all_reduce(torch.ones(8), "dp")
    fingerprint.check(step=1)  # identical so far
    # rank 1 reduces a (2, 4) tensor where the others reduce (8,): same bytes, so nothing hangs
    # or fails yet, but the sequences differ
    comm.all_reduce(torch.ones(2, 4) if rank == 1 else torch.ones(8), "dp")
    comm.all_reduce(torch.ones(3), "dp")
    mismatch = None
    try:
        fingerprint.check(step=2)
    except CollectiveMismatch as e:
        mismatch = str(e)
    params = [("a.weight", torch.ones(4, 4)), ("b.weight", torch.ones(3) * (1.001 if rank == 2 else 1.0))]
    check_replicas(comm, params[:1], step=5)  # equal: passes
    divergence = None
    try:
        check_replicas(comm, params, step=5)
    except ReplicaDivergence as e:
        divergence = str(e)
    return mismatch, divergence


def test_fingerprint_and_replica_hash_name_the_odd_rank(worlds):
    for mismatch, divergence in worlds(4).run(_mismatch_and_divergence):
        assert mismatch is not None and "rank 1 differ from the others" in mismatch
        assert "first difference at dp call #1 since the last check" in mismatch
        assert divergence is not None and "rank 2 hold other weights than rank 0" in divergence
        assert "first differing parameter: b.weight" in divergence


def test_recorder_off_still_counts_bytes(worlds, tmp_path):
    results = worlds(4).run(train_and_report, [*QUICK, "train.steps=2", "debug.history=0", "debug.watchdog=false"],
                            str(tmp_path))
    assert results[0]["records"][1]["comm"]["dp"]["all_reduce"] > 0
