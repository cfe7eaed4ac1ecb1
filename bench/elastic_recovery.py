"""Recovery time of an elastic job after a lost node: kill to the first new step, from storage.

Two "nodes" of `--nproc` processes on this machine (`--nnodes 1:2`, c10d on 127.0.0.1) train
`--model`; node rank 1 loses its launcher at step `--lose-at` (the `lose_node` fault: its first
process SIGKILLs the launcher, the node's processes die with it). The clock starts when the
lost launcher's exit is seen and stops when node 0's metrics.jsonl has the first step of the
shrunk world, so it counts the failure detection, the agent's restart and rendezvous
(`--rdzv-last-call` included), the new processes' start, the checkpoint load from `--out` under
the new layout, and one step. Each round also prints the first step's time of the first
attempt (its processes' start and one step: what a restart costs at least) for comparison.
No in-memory copy of the checkpoint exists yet: this is the "from storage" side only.

    python bench/elastic_recovery.py [--model tiny] [--nproc 2] [--rounds 3] [--out bench/out/elastic_recovery]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_row(path: Path, world: int) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return None
        if row.get("world_size") == world:
            return row
    return None


def wait(condition, node, limit_s: float = 900):
    deadline = time.monotonic() + limit_s
    while (found := condition()) is None:
        if node.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"node 0 ended or timed out (exit {node.poll()})")
        time.sleep(0.01)
    return found


def one_round(args, out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    base = [sys.executable, "-m", "threefold", "train", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--nproc", str(args.nproc), "--model", args.model, "--steps", str(args.lose_at + 4), "--global-batch",
            str(4 * args.nproc), "--seq-len", "64", "--data", "synthetic", "--no-progress", "--set", "run.plot=false",
            "--rdzv-last-call", str(args.last_call), "--max-restarts", "1", "--resume", "auto", "--save-every",
            str(args.lose_at - 1), "--out", str(out), "--set", "fault.kind=lose_node", "--set", "fault.rank=1",
            "--set", f"fault.step={args.lose_at}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    nodes = [subprocess.Popen([*base, "--node-rank", str(r)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(2)]
    metrics = out / "metrics.jsonl"
    wait(lambda: first_row(metrics, 2 * args.nproc), nodes[0])
    first_start = time.monotonic() - started
    nodes[1].wait()
    lost = time.monotonic()
    wait(lambda: first_row(metrics, args.nproc), nodes[0])
    recovery = time.monotonic() - lost
    if nodes[0].wait() != 0:
        raise SystemExit("node 0 did not finish")
    return recovery, first_start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lose-at", type=int, default=6)
    p.add_argument("--last-call", type=float, default=1.0)
    p.add_argument("--out", default="bench/out/elastic_recovery")
    args = p.parse_args()
    out = Path(args.out)
    results = []
    for i in range(args.rounds):
        recovery, first = one_round(args, out / "run")
        results.append((recovery, first))
        print(f"round {i + 1}: kill -> first step on the node left {recovery:.2f} s "
              f"(first start -> first step {first:.2f} s)", flush=True)
    print(f"median: recovery from storage {statistics.median(r for r, _ in results):.2f} s, first start "
          f"{statistics.median(f for _, f in results):.2f} s (--rdzv-last-call {args.last_call:g} s, load "
          f"{os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
