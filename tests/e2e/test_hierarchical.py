"""Two "nodes" of two processes on this machine, joined by torchrun's multi-node rendezvous,
training with the hierarchical all-reduce; the losses match a single-process run."""

import json
import os
import subprocess
import sys

from tests.e2e.cli import SRC, threefold
from threefold.launch import free_port

RUN = ["--model", "tiny", "--steps", "3", "--global-batch", "8", "--seq-len", "16", "--data", "stdlib",
       "--no-progress", "--set", "train.eps=1e-6", "--set", "run.plot=false"]


def node(rank: int, port: int, out) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"hier-{port}", "-m", "threefold", "train", *RUN, "--out", str(out),
           "--set", "compress.hierarchical=true"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_hierarchical_matches_one_process(tmp_path):
    port = free_port()
    nodes = [node(i, port, tmp_path / "hier") for i in range(2)]
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
    hier = rows(tmp_path / "hier")
    assert [r["step"] for r in hier] == [1, 2, 3]
    comm = hier[0]["comm"]  # written by global rank 0: a node leader
    assert comm["dp_intra"]["broadcast"] > 0 and comm["dp_inter"]["all_reduce"] > 0
    assert "all_reduce" not in comm["dp"]  # gradients took the hierarchical path, not the flat ring
    single = threefold("train", *RUN, "--out", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    for a, b in zip(hier, rows(tmp_path / "one")):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
