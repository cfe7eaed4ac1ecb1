"""Recovery time of an elastic job after a lost node: kill to the first new step, with the newest
checkpoint read from storage or from the in-memory copies (`--peer-checkpoint`).

Two "nodes" of `--nproc` processes on this machine (`--nnodes 1:2`, c10d on 127.0.0.1) train a
model whose checkpoint (parameters and AdamW states, ZeRO-1) is `--hidden` x `--layers` sized
(default about 230 MB, so that reading it matters); node rank 1 loses its launcher at step
`--lose-at` (the `lose_node` fault: its first process SIGKILLs the launcher, the node's processes
die with it). The clock starts when the lost launcher's exit is seen and stops when node 0's
metrics.jsonl has the first step of the shrunk world, so it counts the failure detection, the
agent's restart and rendezvous (`--rdzv-last-call` included), the new processes' start, finding
and verifying the checkpoint, loading it under the new layout, and one step.

Each round runs both modes, one after the other, the order alternating from round to round:
`storage` (the checkpoint is read from `--out`) and `peer` (`--peer-checkpoint`: node 0's
launcher holds node 1's files in memory, and the restart reads every file from there). The line
of rank 0 saying where the files came from is printed for each run, so a peer run that read
storage would show. Also printed: the first start to the first step (what any start costs).

    python bench/elastic_recovery.py [--rounds 3] [--hidden 512] [--layers 6] [--out bench/out/elastic_recovery]
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

MODES = ("storage", "peer")


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


def command(args, out: Path, port: int, mode: str) -> list[str]:
    heads = args.hidden // 64
    model = ["--model", "small", "--set", f"model.hidden={args.hidden}", "--set", f"model.layers={args.layers}",
             "--set", f"model.ffn_hidden={4 * args.hidden}", "--set", f"model.heads={heads}", "--set",
             f"model.kv_heads={heads}"]
    return [sys.executable, "-m", "threefold", "train", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--nproc", str(args.nproc), *model, "--zero", "1", "--steps", str(args.lose_at + 1), "--global-batch",
            str(2 * args.nproc), "--seq-len", "32", "--data", "synthetic", "--no-progress", "--set", "run.plot=false",
            "--rdzv-last-call", str(args.last_call), "--max-restarts", "1", "--resume", "auto", "--save-every",
            str(args.lose_at - 1), "--out", str(out), "--set", "fault.kind=lose_node", "--set", "fault.rank=1",
            "--set", f"fault.step={args.lose_at}", *(["--peer-checkpoint"] if mode == "peer" else [])]


def one_run(args, out: Path, mode: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    base = command(args, out, free_port(), mode)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(out.parent / f"{mode}-node{r}.log", "w") for r in range(2)]
    started = time.monotonic()
    nodes = [subprocess.Popen([*base, "--node-rank", str(r)], env=env, stdout=subprocess.DEVNULL, stderr=logs[r])
             for r in range(2)]
    metrics = out / "metrics.jsonl"
    wait(lambda: first_row(metrics, 2 * args.nproc), nodes[0])
    first_start = time.monotonic() - started
    nodes[1].wait()
    lost = time.monotonic()
    wait(lambda: first_row(metrics, args.nproc), nodes[0])
    recovery = time.monotonic() - lost
    if nodes[0].wait() != 0:
        raise SystemExit(f"node 0 did not finish (see {out.parent / f'{mode}-node0.log'})")
    for log in logs:
        log.close()
    text = (out.parent / f"{mode}-node0.log").read_text().splitlines()
    loaded = next((line for line in text if line.startswith("threefold: loaded")), "")
    resumed = next((line for line in text if line.startswith("threefold: resumed from")), "")
    ckpt = Path(resumed.split()[3]) if resumed else None
    size = json.loads((ckpt / "manifest.json").read_text()) if ckpt and ckpt.exists() else {}
    return {"recovery": recovery, "first": first_start, "loaded": loaded.removeprefix("threefold: "),
            "bytes": sum(f["bytes"] for f in size.get("files", {}).values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lose-at", type=int, default=3)
    p.add_argument("--last-call", type=float, default=1.0)
    p.add_argument("--out", default="bench/out/elastic_recovery")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            r = one_run(args, out / "run", mode)
            results[mode].append(r)
            print(f"round {i + 1} {mode:7s}: kill -> first step on the node left {r['recovery']:.2f} s (first start "
                  f"-> first step {r['first']:.2f} s; checkpoint {r['bytes'] / 1e6:.0f} MB; "
                  f"{r['loaded'] or 'no load line'}; load {os.getloadavg()[0]:.2f})", flush=True)
    med = {m: statistics.median(r["recovery"] for r in results[m]) for m in MODES}
    first = statistics.median(r["first"] for m in MODES for r in results[m])
    print(f"median recovery: storage {med['storage']:.2f} s, peer memory {med['peer']:.2f} s "
          f"(storage / peer = {med['storage'] / med['peer']:.2f}x); first start {first:.2f} s "
          f"(--rdzv-last-call {args.last_call:g} s, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
