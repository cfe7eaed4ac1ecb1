"""How long `threefold plan` takes to search a large layout space, from a fresh interpreter.

Each round starts `threefold plan` in a new process (so the time includes Python's start and
every import: what a user waits for) and, separately, times `planner.search` alone in this
process (wall and CPU time: the CPU time is what the search costs on a machine others load). It prints
the times of each round, the number of strategies evaluated, the medians and the machine's load average
(a loaded machine stretches every wall figure). There is no PyTorch counterpart: the planner runs
without torch.

    python bench/plan_search.py --model llama-405b --gpus 16384 --gpu h100-80gb --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def cli_seconds(args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "threefold", "plan", "--model", args.model, "--gpus", str(args.gpus),
           "--gpu", args.gpu, "--top", "3"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"plan failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed


def search_seconds(args: argparse.Namespace) -> tuple[float, int, str]:
    from types import SimpleNamespace

    from threefold.planner import load_gpu, search
    from threefold.planner.command import _workload

    # the CLI's assumed global batch (kept where a layout splits it; the CLI raises it only when none does)
    w, _ = _workload(SimpleNamespace(model=args.model, overrides=[], seq_len=None, global_batch=None, gpus=args.gpus,
                                     optimizer="adamw"))
    start, cpu = time.perf_counter(), time.process_time()
    result = search(w, args.gpus, load_gpu(args.gpu))
    search_seconds.cpu.append(time.process_time() - cpu)  # what the search costs, whatever else the machine runs
    return time.perf_counter() - start, result.evaluated, result.best.strategy.label() if result.best else "-"


search_seconds.cpu = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-405b")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cli, inner = [], []
    for r in range(args.rounds):  # alternate the two measurements
        cli.append(cli_seconds(args))
        s, evaluated, best = search_seconds(args)
        inner.append(s)
        print(f"round {r + 1}: threefold plan (fresh process) {cli[-1]:.2f} s, search alone {s:.2f} s "
              f"({search_seconds.cpu[-1]:.2f} s of CPU) "
              f"({evaluated} strategies; best {best})")
    print(f"median: threefold plan {statistics.median(cli):.2f} s, search alone {statistics.median(inner):.2f} s "
          f"({statistics.median(search_seconds.cpu):.2f} s of CPU) "
          f"for {args.model} on {args.gpus} x {args.gpu}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
