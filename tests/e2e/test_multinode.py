"""Two "nodes" of two processes on this machine, started three ways (threefold's own
`--nnodes` launcher, plain torchrun, and the Slurm script's command with Slurm's variables set
by hand), each under another layout; every node's launcher exits 0, the node holding global
rank 0 has every step once, and the losses match one process within relative 1e-5."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.cli import SRC, threefold
from threefold.launch import free_port

RUN = ["--model", "tiny", "--steps", "3", "--global-batch", "8", "--seq-len", "16", "--data", "stdlib",
       "--no-progress", "--set", "train.eps=1e-6", "--set", "run.plot=false"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def environment(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in LAUNCHER_VARS + tuple(v for v in env if v.startswith("SLURM_")):
        env.pop(var, None)
    env.update(extra)
    return env


def node_command(how: str, rank: int, port: int, args: list[str]) -> tuple[list[str], dict]:
    train = ["train", *RUN, *args]
    if how == "threefold":
        return ([sys.executable, "-m", "threefold", *train[:1], "--nnodes", "2", "--node-rank", str(rank),
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc", "2", *train[1:]], environment())
    if how == "torchrun":
        return ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                 "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", f"t{port}", "-m", "threefold", *train], environment())
    # examples/slurm.sbatch: `srun --ntasks-per-node=1 threefold train --nproc $GPUS ...` on each node
    slurm = dict(SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
                 SLURM_NODEID=str(rank), SLURM_PROCID=str(rank), SLURM_LOCALID="0",
                 SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return [sys.executable, "-m", "threefold", *train[:1], "--nproc", "2", *train[1:]], environment(**slurm)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    done = threefold("train", *RUN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return [r["loss"] for r in rows(out)]


def gradient_bytes() -> int:
    """fp32 gradient bytes of the tiny model, from its parameters."""
    import torch

    from threefold.config import load_config
    from threefold.models.decoder import build_model

    cfg = load_config(None, ["model.preset=tiny"])
    model = build_model(cfg.model, 0, torch.device("cpu"))
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * 4


CASES = [  # (how the nodes start, layout options)
    ("threefold", ["--dp", "4", "--set", "compress.hierarchical=true"]),
    ("slurm", ["--dp", "2", "--tp", "2"]),
    ("torchrun", ["--dp", "2", "--pp", "2", "--microbatches", "2"]),
]


@pytest.mark.parametrize("how,layout", CASES, ids=[c[0] for c in CASES])
def test_two_nodes_match_one_process(tmp_path, one_process, how, layout):
    port, out = free_port(), tmp_path / "run"
    starts = [node_command(how, rank, port, [*layout, "--out", str(out)]) for rank in range(2)]
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in starts]
    outputs = [p.communicate(timeout=400) for p in nodes]
    for p, (_, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
    records = rows(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for got, want in zip([r["loss"] for r in records], one_process):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    if how == "threefold":  # rank 0 leads node 0: its ring of 2 leaders sends 2 (2-1)/2 S = S across nodes
        assert records[0]["comm"]["dp_inter"]["all_reduce"] == gradient_bytes()
        assert records[0]["comm_inter_node"] == {"dp": 0, "dp_inter": gradient_bytes()}
        assert (out / "logs" / "rank-3.log").exists()
