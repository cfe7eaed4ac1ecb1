"""Time a training step waits for data, against the step time, for the `small` model.

One process trains from a prepared directory with batches prepared ahead (data.prefetch=2,
the default) and, alternating, with batches made inside the step (data.prefetch=0). Both read
`data_wait_s` and `step_time_s` from the run's metrics.jsonl (the first step, which starts the
background thread and warms the caches, is left out).

    python bench/data_loader.py --data DIR [--steps 20] [--rounds 2] [--model small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path

from threefold.config import load_config
from threefold.train.trainer import train


def run(args, prefetch: int, out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    train(load_config(None, [f"model.preset={args.model}", f"data.source={args.data}", f"train.steps={args.steps}",
                             f"train.seq_len={args.seq_len}", f"train.global_batch={args.global_batch}",
                             f"data.prefetch={prefetch}", f"run.out={out}", "run.progress=false", "run.plot=false"]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return statistics.mean(r["data_wait_s"] for r in rows), statistics.mean(r["step_time_s"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/out/data_loader")
    args = p.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        for prefetch in (2, 0):
            wait, step = run(args, prefetch, Path(args.out) / f"{r}-{prefetch}")
            print(f"round {r} data.prefetch={prefetch}: waited {wait * 1e3:.3f} ms per step, step {step * 1e3:.1f} ms: "
                  f"{100 * wait / step:.3f}% of the step time")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
