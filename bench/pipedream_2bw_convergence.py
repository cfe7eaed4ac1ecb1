"""PipeDream-2BW against 1F1B: the same tiny model, data and tokens, pp=2, CPU gloo.

    PYTHONPATH=src:. python bench/pipedream_2bw_convergence.py [--steps 600] [--microbatches 4]

Trains twice through the command line, `--schedule 1f1b` and `--schedule pipedream-2bw`, with
every other setting equal (what 2BW needs: train.grad_clip=0, untied embeddings - both runs), and
prints each run's final loss (the mean of the last 20 steps' training losses), the ratio 2BW / 1F1B
and the step times; draws both loss curves to docs/images/pipedream-2bw-convergence.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(schedule: str, steps: int, m: int, out: Path) -> list[dict]:
    args = [sys.executable, "-m", "threefold", "train", "--nproc", "2", "--pp", "2", "--microbatches", str(m),
            "--schedule", schedule, "--model", "tiny", "--set", f"train.steps={steps}", "--set", "train.grad_clip=0",
            "--set", "model.tie_embeddings=false", "--set", "run.progress=false", "--set", f"run.out={out}"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    subprocess.run(args, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--tail", type=int, default=20, help="final loss: mean of the last TAIL steps")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "pipedream-2bw-convergence.png"))
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("1f1b", "pipedream-2bw"):
            runs[schedule] = train(schedule, args.steps, args.microbatches, Path(tmp) / schedule)
    final = {}
    for schedule, records in runs.items():
        tail = records[-args.tail:]
        final[schedule] = sum(r["loss"] for r in tail) / len(tail)
        times = sorted(r["step_time_s"] for r in records[1:])
        print(f"{schedule:14s} steps {len(records)}  tokens {sum(r['tokens'] for r in records)}  "
              f"final loss (mean of last {len(tail)}) {final[schedule]:.4f}  median step {times[len(times) // 2] * 1e3:.1f} ms")
    ratio = final["pipedream-2bw"] / final["1f1b"]
    print(f"ratio pipedream-2bw / 1f1b = {ratio:.4f} ({(ratio - 1) * 100:+.2f} %)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for schedule, records in runs.items():
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{schedule} "
                    f"(final {final[schedule]:.3f})", linewidth=1)
        ax.set_xlabel("step (same tokens per step)")
        ax.set_ylabel("training loss")
        ax.set_title(f"tiny model, pp=2, m={args.microbatches}: 2BW / 1F1B final loss = {ratio:.4f}")
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
