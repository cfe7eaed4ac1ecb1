"""How data parallelism communicates: overlap with backward, exact bytes, accumulation, unused parameters."""

import time

import torch

from tests.helpers import make_config, rel_err
from threefold.comm import Comm, ring_chunk
from threefold.mesh import Layout, Mesh
from threefold.models.decoder import build_model
from threefold.parallel.data import parallelize_data
from threefold.sharding import Placement
from threefold.train.step import global_grad_norm

BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "train.steps=4", "train.eps=1e-6"]


def overlap_and_bytes(n: int) -> dict:
    mesh = Mesh(Layout(dp=n), torch.device("cpu"))
    comm = Comm(mesh)
    cfg = make_config(["model.preset=tiny", "model.layers=4"], "unused").model
    model = build_model(cfg, seed=0)
    reducer = parallelize_data(model, comm, bucket_mb=0.01)  # ~10 KB buckets: several per backward
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(mesh.rank("dp")))
    reducer.zero_grad()
    with reducer.micro_batch(last=True):
        (model(tokens, tokens) / 64).backward()
        backward_done = time.monotonic()
    reducer.finish()
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = sum(2 * (b.numel() - ring_chunk(b.numel(), n, mesh.rank("dp"))) * 4 for b in reducer.buckets.buckets)
    return {"launches": reducer.buckets.launch_log, "backward_done": backward_done,
            "n_params": len(trainable), "n_buckets": len(reducer.buckets.buckets),
            "bytes": comm.traffic.total_bytes("dp", "all_reduce"), "expected": expected,
            "grad_bytes": sum(p.numel() * 4 for p in trainable),
            "grads": [p.grad.clone() for p in trainable], "tokens": tokens}


def unused_parameter_on_one_rank() -> list:
    """Rank 1 never uses the last block: its gradients are zero there, yet all buckets are reduced."""
    mesh = Mesh(Layout(dp=2), torch.device("cpu"))
    comm = Comm(mesh)
    model = build_model(make_config(["model.preset=tiny"], "unused").model, seed=0)
    reducer = parallelize_data(model, comm, bucket_mb=0.01)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    reducer.zero_grad()
    with reducer.micro_batch(last=True):
        x = model.embed(tokens)
        blocks = model.blocks if mesh.rank("dp") == 0 else model.blocks[:-1]
        for block in blocks:
            x = block(x)
        model.loss(model.head(model.norm(x)), tokens).backward()
    reducer.finish()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def norm_of_replicated_gradients() -> dict:
    """The global norm after a dense sum, computed by each replica alone and summed over dp."""
    mesh = Mesh(Layout(dp=2), torch.device("cpu"))
    comm = Comm(mesh)
    model = build_model(make_config(["model.preset=tiny"], "unused").model, seed=0)
    reducer = parallelize_data(model, comm)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(mesh.rank("dp")))
    reducer.zero_grad()
    with reducer.micro_batch(last=True):
        (model(tokens, tokens) / 64).backward()
    reducer.finish()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    placements = [Placement.whole(n, p.shape).replicated("dp") for n, p in named]
    comm.traffic.take_window()
    local = global_grad_norm(params, placements, comm, "dp", replicated=reducer.replicated)
    local_ops = comm.traffic.take_window().get("dp", {})  # collectives issued (a scalar's ring share may be 0 bytes)
    summed = global_grad_norm(params, placements, comm, "dp", replicated=False)
    whole = torch.cat([p.grad.flatten() for p in params]).double().norm()
    return {"replicated": reducer.replicated, "local": local, "summed": summed, "whole": whole,
            "local_ops": sorted(local_ops), "summed_ops": sorted(comm.traffic.take_window().get("dp", {}))}


def test_replicas_take_the_norm_without_a_collective(worlds):
    """After a dense sum every replica holds the same gradients: the norm needs no sum over dp
    (as DDP clips locally), and each replica's own value is bitwise the summed one."""
    for r in worlds(2).run(norm_of_replicated_gradients):
        assert r["replicated"]
        assert r["local_ops"] == [] and r["summed_ops"] == ["all_reduce.grad_norm"]
        assert torch.equal(r["local"], r["summed"])
        assert abs(float(r["local"]) / float(r["whole"]) - 1) < 1e-6


def test_overlap_and_exact_ring_bytes(worlds):
    results = worlds(4).run(overlap_and_bytes, 4)
    for r in results:
        assert r["n_buckets"] >= 4
        first_bucket, hooks_fired_at_launch, launched_at = r["launches"][0]
        # the first all-reduce started while autograd still had gradients to produce
        assert hooks_fired_at_launch < r["n_params"]
        assert launched_at < r["backward_done"]
        assert sum(1 for _, fired, _ in r["launches"] if fired < r["n_params"]) >= r["n_buckets"] // 2
        assert r["bytes"] == r["expected"]
    # summed over ranks: exactly 2 (n-1) x gradient bytes, the ring all-reduce volume
    assert sum(r["bytes"] for r in results) == 2 * 3 * results[0]["grad_bytes"]
    # and the reduced gradients are the sum of every rank's local gradients
    model = build_model(make_config(["model.preset=tiny", "model.layers=4"], "unused").model, seed=0)
    for r in results:
        (model(r["tokens"], r["tokens"]) / 64).backward()
    local = [p.grad for p in model.parameters() if p.requires_grad]
    for got, want in zip(results[0]["grads"], local):
        assert rel_err(got, want) < 1e-5


def test_unused_parameters_still_reduce(worlds):
    a, b = worlds(2).run(unused_parameter_on_one_rank)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def accumulation_pair(out: str) -> dict:
    from threefold.train.trainer import Trainer

    whole = Trainer(make_config(BASE, out))
    whole.run()
    accumulated = Trainer(make_config(BASE + ["train.microbatches=4"], out))
    records = accumulated.run()
    pa = dict(whole.parallel.module.named_parameters())
    worst = max(rel_err(p, pa[n]) for n, p in accumulated.parallel.module.named_parameters())
    # accumulation communicates only once per step, like the single micro-batch
    return {"worst": worst, "bytes": [r["comm"]["dp"]["all_reduce"] for r in records]}


def test_accumulation_equals_whole_batch(worlds, tmp_path):
    for r in worlds(2).run(accumulation_pair, str(tmp_path)):
        assert r["worst"] <= 1e-5
        assert len(set(r["bytes"])) == 1
