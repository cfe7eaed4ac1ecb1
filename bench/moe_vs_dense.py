"""A small mixture of experts against the dense model of the same active parameters, at equal tokens.

`small` (dense MLP of 1024) and `small-moe` (8 experts of 512, top-2: the same active MLP width,
3.29M active parameters of 9.59M) train on the Python standard library (prepared at the byte
level, 2% held out) with the same data order, steps and learning rate; the validation loss of
each is printed at the end. The MoE's logged `loss` includes its auxiliary losses; the
validation loss compared here is the evaluation's. The expert load of the MoE run over training
(observe/plots.py) is written to `--plot` (default bench/out/expert_load.png).

    PYTHONPATH=src python bench/moe_vs_dense.py --steps 150 --out /tmp/moe-vs-dense
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path


def run(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "threefold", *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default="runs/moe-vs-dense")
    p.add_argument("--plot", default=str(Path(__file__).parent / "out" / "expert_load.png"))
    a = p.parse_args()
    out = Path(a.out)
    data = out / "data"
    if not (data / "index.json").exists() and not data.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        run(["data", "prepare", str(stdlib / "*.py"), "--out", str(data), "--val-fraction", "0.02"])
    common = ["--data", str(data), "--steps", str(a.steps), "--global-batch", "16", "--seq-len", "128",
              "--lr", "1e-3", "--no-progress", "--set", f"train.eval_every={a.steps}", "--set", "train.eval_batches=8",
              "--set", "run.plot=false", "--set", "train.warmup_steps=10"]
    results = {}
    for model in ("small", "small-moe"):
        run(["train", "--model", model, "--out", str(out / model), "--overwrite", *common])
        rows = [json.loads(line) for line in (out / model / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        results[model] = last
        print(f"{model}: step {last['step']} train loss {last['loss']:.4f} val loss {last['val_loss']:.4f} "
              f"tokens {a.steps * 16 * 128} {sum(r['step_time_s'] for r in rows):.0f} s", flush=True)
    from threefold.observe.plots import plot_expert_load, read_metrics

    Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
    print(f"expert load: {plot_expert_load(read_metrics(out / 'small-moe' / 'metrics.jsonl'), Path(a.plot))}")
    gap = results["small"]["val_loss"] - results["small-moe"]["val_loss"]
    print(f"validation loss: dense {results['small']['val_loss']:.4f}, moe {results['small-moe']['val_loss']:.4f} "
          f"(moe lower by {gap:.4f})")


if __name__ == "__main__":
    main()
