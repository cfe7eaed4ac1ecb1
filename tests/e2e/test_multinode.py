"""Two "nodes" of two processes on this machine, started three ways (threefold's own
`--nnodes` launcher, plain torchrun, and the Slurm script's command with Slurm's variables set
by hand), each under another layout; every node's launcher exits 0 (threefold's: with nothing
but threefold's lines on its terminal), the node holding global rank 0 has every step once, and
the losses match one process within relative 1e-5. Then an
elastic job (`--nnodes 1:2`, with in-memory peer copies of its checkpoints) loses a node, goes
on with the node left from the copies in memory, and grows back."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.e2e.cli import SRC, threefold
from threefold.launch.local import free_port

STEPS = 8
RUN = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--seq-len", "16", "--data", "stdlib",
       "--no-progress", "--set", "train.eps=1e-6", "--set", "run.plot=false"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def environment(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in LAUNCHER_VARS + tuple(v for v in env if v.startswith("SLURM_")):
        env.pop(var, None)
    env.update(extra)
    return env


def node_command(how: str, rank: int, port: int, args: list[str], nnodes: str = "2") -> tuple[list[str], dict]:
    train = ["train", *RUN, *args]
    if how == "threefold":
        return ([sys.executable, "-m", "threefold", *train[:1], "--nnodes", nnodes, "--node-rank", str(rank),
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
    """The complete records of metrics.jsonl (a line being written, or none yet, is left out)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


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
    if how == "threefold":  # whichever node ends first, the other's terminal has threefold's lines only
        for _, err in outputs:
            assert all(line.startswith("threefold:") for line in err.splitlines() if line.strip()), err[-3000:]
    records = rows(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip([r["loss"] for r in records], one_process):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    if how == "threefold":  # rank 0 leads node 0: its ring of 2 leaders sends 2 (2-1)/2 S = S across nodes
        assert records[0]["comm"]["dp_inter"]["all_reduce"] == gradient_bytes()
        # over the whole dp axis only the logged loss and the stop flag (train/preempt.py) cross nodes
        dp = records[0]["comm"].get("dp", {})
        assert set(dp) <= {"all_reduce.metrics"}, dp
        assert records[0]["comm_inter_node"] == {"dp": sum(dp.values()), "dp_inter": gradient_bytes()}
        assert (out / "logs" / "rank-3.log").exists()


# ---------------------------------------------------------------- elastic shrink and grow

# ZeRO-1: every rank writes a file of its optimizer shard, so node 1's files are needed after the loss
ELASTIC = ["--rdzv-last-call", "1", "--max-restarts", "2", "--resume", "auto", "--save-every", "3",
           "--peer-checkpoint", "--zero", "1"]
LOSE_AT = 6  # node rank 1 loses its launcher at the start of step 6; the newest checkpoint is step 3
WAIT_S = 600  # upper bounds only: every wait below ends on an event, on a loaded machine too


def wait_for(condition, what: str, *processes):
    deadline = time.monotonic() + WAIT_S
    while not (result := condition()):
        ended = [p.name for p in processes if p.poll() is not None]
        assert not ended and time.monotonic() < deadline, f"{what}: not seen ({ended or 'timeout'})"
        time.sleep(0.05)
    return result


def node_workers(out) -> dict[int, int]:
    """pid -> parent pid of every worker process of the run in `out`."""
    found = {}
    for proc in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{proc}/cmdline", "rb").read().split(b"\0")
            stat = open(f"/proc/{proc}/stat").read()
        except OSError:
            continue
        if b"--node-worker" in cmdline and str(out).encode() in b" ".join(cmdline) and ") Z" not in stat:
            found[int(proc)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def step_rows(out, world: int):
    """The records of steps 4 and 5 when both ran in a world of `world` processes, else None."""
    records = {r["step"]: r for r in rows(out)}
    ran = [records.get(s) for s in (LOSE_AT - 2, LOSE_AT - 1)]
    return ran if all(r is not None and r["world_size"] == world for r in ran) else None


def test_elastic_shrink_and_grow(tmp_path, one_process):
    """--nnodes 1:2: node 1's launcher dies at step 6 (its workers with it), the job goes on with
    node 0 from checkpoint 3 (ZeRO-1) under dp=2 x 2 micro-batches (the same global batch), read from the
    launchers' memory (node 0 keeps node 1's files), bitwise equal to a one-node run resumed from
    that checkpoint on storage; node 1 joins again and the job finishes on both."""
    port, out, hold = free_port(), tmp_path / "run", tmp_path / "hold"
    hold.touch()  # the attempts after the loss wait at step 6 until the test has seen what it needs
    lose = ["fault.kind=lose_node", "fault.rank=1", f"fault.step={LOSE_AT}", f"fault.hold_file={hold}"]
    started = []

    def start(rank: int, sets: list[str], name: str):
        cmd, env = node_command("threefold", rank, port, [*ELASTIC, "--out", str(out),
                                                          *[a for s in sets for a in ("--set", s)]], nnodes="1:2")
        with open(tmp_path / f"{name}.log", "w") as log:
            node = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        node.name = name
        started.append(node)
        return node

    def output(node, tail: int | None = 3000) -> str:
        text = (tmp_path / f"{node.name}.log").read_text()
        return text[-tail:] if tail else text

    try:
        node0, node1 = start(0, lose, "node0"), start(1, lose, "node1")
        assert node1.wait(timeout=WAIT_S) == -9, output(node1)
        # no worker of the lost node outlives its launcher
        wait_for(lambda: all(parent == node0.pid for parent in node_workers(out).values()), "orphans gone", node0)
        assert all(r["step"] < LOSE_AT for r in rows(out)), "node 1's workers outlived their launcher and went on"
        shrunk = wait_for(lambda: step_rows(out, 2), "steps 4-5 on the node left", node0)
        checkpoint = tmp_path / "step-3"
        shutil.copytree(out / "checkpoints" / "step-00000003", checkpoint)
        rejoined = start(1, [], "rejoined")
        grown = wait_for(lambda: step_rows(out, 4), "steps 4-5 on both nodes again", node0, rejoined)
        hold.unlink()
        for p in (node0, rejoined):
            assert p.wait(timeout=WAIT_S) == 0, output(p)
    finally:  # a failed check leaves no launcher behind
        for node in started:
            if node.poll() is None:
                node.kill()

    assert [r["microbatches"] for r in shrunk] == [2, 2] and [r["microbatches"] for r in grown] == [1, 1]
    assert {r["tokens"] for r in shrunk + grown} == {8 * 16}  # the global batch never changed
    # the restart after the loss read every file of checkpoint 3 from memory, none from storage
    text = output(node0, tail=None)
    loaded = [line for line in text.splitlines() if line.startswith("threefold: loaded step-00000003")]
    assert loaded and loaded[0].endswith(" from peer memory, 0 from storage"), text[-3000:]
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert len(files) == 4, files  # node 1's two files were among them
    assert "warning: checkpoint.peer_copy" not in text
    resumed = tmp_path / "resumed"
    done = threefold("train", *RUN, "--nproc", "2", "--dp", "2", "--microbatches", "2", "--zero", "1", "--resume",
                     str(checkpoint), "--out", str(resumed))  # one node of 2 processes, the shrunk layout, from storage
    assert done.returncode == 0, done.stderr
    assert [(r["step"], r["loss"]) for r in shrunk] == [(r["step"], r["loss"]) for r in rows(resumed)[:2]]
    final = rows(out)
    assert [r["step"] for r in final] == list(range(1, STEPS + 1))
    for got, want in zip([r["loss"] for r in final], one_process):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
