"""ZeRO-3 with 8-bit communication (parallel.zero_weight_comm / zero_grad_comm): bytes counted by Comm,
and the training stays close to the fp32-wire ZeRO-3 run."""

import os
import subprocess
import sys

import torch

from tests.e2e.cli import SRC
from tests.helpers import rel_err
from tests.local_sgd_tasks import train_runs
from threefold.comm.quantize import fp8_supported

BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=16", "train.steps=8", "train.lr=2e-3",
        "parallel.zero=3"]
RUNS = {"int8 weights + int8 gradients": ["parallel.zero_weight_comm=int8", "parallel.zero_grad_comm=int8"],
        "fp8 weights": ["parallel.zero_weight_comm=fp8"]}


def dp_bytes(rows: list[dict]) -> int:
    return sum(n for row in rows for op, n in row.get("dp", {}).items() if "." not in op)


def test_quantized_zero3_sends_fewer_bytes_and_trains_alike(worlds, tmp_path, capsys):
    runs = {name: extra for name, extra in RUNS.items() if "fp8" not in name or fp8_supported(torch.device("cpu"))}
    per_rank = worlds(2).run(train_runs, [(BASE, str(tmp_path / "fp32"))] +
                             [(BASE + extra, str(tmp_path / f"q{i}")) for i, extra in enumerate(runs.values())])
    dense = per_rank[0][0]
    lines = []
    for i, name in enumerate(runs, 1):
        got = per_rank[0][i]
        ratio = dp_bytes(dense["comm"]) / dp_bytes(got["comm"])
        loss = abs(got["losses"][-1] - dense["losses"][-1]) / dense["losses"][-1]
        # the parameters as one vector: Adam moves near-zero tensors (biases) by lr whatever the gradient's size
        names = sorted(dense["params"])
        param = rel_err(torch.cat([got["params"][k].reshape(-1) for k in names]),
                        torch.cat([dense["params"][k].reshape(-1) for k in names]))
        lines.append(f"{name}: dp bytes {ratio:.2f}x fewer, final loss {loss:.1e}, parameters {param:.1e}")
        assert loss <= 1e-2 and param <= 3e-2, lines[-1]
        assert got["losses"][-1] < got["losses"][0] - 0.1, lines[-1]  # it trains
        if "gradients" in name:
            assert ratio >= 3.5, lines[-1]
            assert all(set(row["dp"]) >= {"all_gather", "all_to_all"} and "reduce_scatter" not in row["dp"]
                       for row in got["comm"])
    with capsys.disabled():
        print("\nZeRO-3, dp=2, 8 steps, against the fp32 wire:\n  " + "\n  ".join(lines))


def collective_checks() -> dict:
    from threefold.comm import Comm
    from threefold.comm.quantize import quantized_all_gather, quantized_reduce_scatter
    from threefold.mesh import Layout, Mesh

    mesh = Mesh(Layout(dp=2), torch.device("cpu"))
    comm, rank = Comm(mesh), mesh.rank("dp")
    g = torch.Generator().manual_seed(rank)
    grads = torch.randn(2 * 700, generator=g) * (1 + rank)  # two chunks of 700 (not a multiple of 256)
    exact = torch.empty(700)
    comm.reduce_scatter(exact, grads.clone(), "dp")
    got = torch.empty(700)
    quantized_reduce_scatter(comm, got, grads, "dp").wait()
    shard = torch.randn(700, generator=g)
    whole, whole_q = torch.empty(1400), torch.empty(1400)
    comm.all_gather(whole, shard, "dp")
    quantized_all_gather(comm, whole_q, shard, "dp", "int8").wait()
    return {"rs": (got - exact).abs().max().item(), "rs_scale": exact.abs().max().item(),
            "ag": (whole_q - whole).abs().max().item(), "ag_scale": whole.abs().max().item()}


def test_quantized_collectives_are_the_exact_ones_to_the_int8_bound(worlds):
    for r in worlds(2).run(collective_checks):
        # each contribution is off by at most max|block| / 254; the sum of two contributions twice that
        assert 0 < r["rs"] <= 2 * 4 * r["rs_scale"] / 254, r
        assert 0 < r["ag"] <= r["ag_scale"] / 254 * 1.0001, r


FP8_UNSUPPORTED = """
import sys
import threefold.parallel.sync_kinds
threefold.parallel.sync_kinds.fp8_supported = lambda device: False  # a device whose torch cannot cast to e4m3
from threefold.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_fp8_on_a_device_without_it_exits_2_with_one_line(tmp_path):
    """The capability check is patched (this CPU build casts to fp8); the rest is the real command."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    run = subprocess.run([sys.executable, "-c", FP8_UNSUPPORTED, "train", "--model", "tiny", "--steps", "2",
                          "--global-batch", "2", "--seq-len", "16", "--no-progress", "--out", str(tmp_path),
                          "--set", "parallel.zero=3", "--set", "parallel.zero_weight_comm=fp8"],
                         capture_output=True, text=True, timeout=300, env=env)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0] == ("threefold: error: parallel.zero_weight_comm: this torch cannot cast to float8_e4m3fn on "
                        "cpu; use parallel.zero_weight_comm=int8"), lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()
