"""Muon against AdamW at its tuned learning rate: loss curves on the Python standard library (docs/zero.md).

The tiny decoder widened to hidden 64 (2 blocks, 4 heads, ffn 256, byte vocabulary) trains on
`data.source=stdlib` with the same data order, steps, warm-up and cosine schedule for every run:
AdamW (`train.optimizer=adamw`) at each of `--adamw-lrs`, Muon (`train.optimizer=muon`: momentum 0.95,
Nesterov, 5 Newton-Schulz steps, the registry's defaults; AdamW on the embedding, head and 1-D
parameters) at each of `--muon-lrs`. Muon's update carries Moonlight's scale (0.2 sqrt(max(m, n))), so
one `train.lr` serves both optimizers and its learning rates sit on AdamW's scale, not Keller Jordan's
0.02. AdamW's tuned rate is the one of its sweep with the lowest final loss (mean of the last
`--window` steps, then over seeds). Prints each run's final loss, then per setting the mean over seeds
and the ratio to tuned AdamW's; plots the loss curves (mean over seeds, running mean of 10 steps) to
`--plot`. One torch thread per run; `--jobs N` runs N side by side.

    PYTHONPATH=src nice -n 2 python bench/muon_convergence.py --steps 200 --seeds 2 --jobs 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODEL = ["model.preset=tiny", "model.hidden=64", "model.heads=4", "model.kv_heads=4", "model.ffn_hidden=256"]


def losses(optimizer: str, lr: float, steps: int, seed: int, out: str, batch: int = 16, seq: int = 64) -> list[float]:
    """One run's per-step training losses."""
    from threefold.config import load_config
    from threefold.train.trainer import train

    cfg = load_config(None, [*MODEL, f"train.optimizer={optimizer}", f"train.lr={lr}", "data.source=stdlib",
                             f"train.steps={steps}", f"train.seed={seed}", f"train.global_batch={batch}",
                             f"train.seq_len={seq}", f"train.warmup_steps={max(1, steps // 20)}", "run.threads=1",
                             f"run.out={out}", "run.progress=false", "run.plot=false"])
    with contextlib.redirect_stderr(io.StringIO()):
        return [r["loss"] for r in train(cfg)]


def job(spec: tuple[str, float, int], steps: int, tmp: str, batch: int, seq: int) -> tuple[tuple, list[float]]:
    optimizer, lr, seed = spec
    return spec, losses(optimizer, lr, steps, seed, f"{tmp}/{optimizer}-{lr}-{seed}", batch, seq)


def run_all(specs: list[tuple[str, float, int]], steps: int, jobs: int, batch: int = 16, seq: int = 64) -> dict:
    """{(optimizer, lr, seed): losses}; side by side in `jobs` processes (in this one when jobs = 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        if jobs == 1:
            return dict(job(s, steps, tmp, batch, seq) for s in specs)
        with ProcessPoolExecutor(jobs) as pool:
            return dict(pool.map(job, specs, *zip(*[(steps, tmp, batch, seq)] * len(specs))))


def table(curves: dict, window: int) -> tuple[dict[tuple[str, float], dict], float]:
    """Per (optimizer, lr): final losses by seed and their mean; and AdamW's tuned learning rate."""
    rows: dict[tuple[str, float], dict] = {}
    for (optimizer, lr, seed), curve in sorted(curves.items()):
        row = rows.setdefault((optimizer, lr), {"finals": [], "curves": []})
        row["finals"].append(statistics.mean(curve[-window:]))
        row["curves"].append(curve)
    for row in rows.values():
        row["final"] = statistics.mean(row["finals"])
    tuned = min((lr for optimizer, lr in rows if optimizer == "adamw"), key=lambda lr: rows[("adamw", lr)]["final"])
    return rows, tuned


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--muon-lrs", default="3e-3,1e-2")
    p.add_argument("--window", type=int, default=20, help="final loss: the mean of the last this many steps")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" / "images" / "muon_convergence.png"))
    p.add_argument("--json", default="", help="write the curves and the table to this file")
    a = p.parse_args(argv)
    specs = [(opt, float(lr), seed) for seed in range(a.seeds)
             for opt, lrs in (("adamw", a.adamw_lrs), ("muon", a.muon_lrs)) for lr in lrs.split(",")]
    curves = run_all(specs, a.steps, a.jobs, a.batch, a.seq)
    rows, tuned = table(curves, min(a.window, a.steps))
    best = rows[("adamw", tuned)]["final"]
    print(f"{a.steps} steps x {a.seeds} seeds, {a.batch} x {a.seq} tokens a step; final loss = mean of the last "
          f"{min(a.window, a.steps)} steps; AdamW's tuned lr {tuned:g} (final {best:.4f})")
    for (optimizer, lr), row in rows.items():
        print(f"  {optimizer:5} lr {lr:<6g} final {row['final']:.4f} (seeds: "
              + ", ".join(f"{f:.4f}" for f in row["finals"]) + f")  / tuned AdamW {row['final'] / best:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tuned": tuned,
                                            "rows": [[o, lr, r["finals"]] for (o, lr), r in rows.items()],
                                            "curves": [[*k, v] for k, v in curves.items()]}))
    if a.plot:
        plot(rows, tuned, Path(a.plot), f"tiny (hidden 64), {a.steps} steps, mean of {a.seeds} seeds")
    return {"rows": rows, "tuned": tuned}


def plot(rows: dict, tuned: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (optimizer, lr), row in rows.items():
        mean = [statistics.mean(step) for step in zip(*row["curves"])]
        smooth = [statistics.mean(mean[max(0, i - 9): i + 1]) for i in range(len(mean))]
        tag = " (tuned)" if optimizer == "adamw" and lr == tuned else ""
        ax.plot(range(1, len(smooth) + 1), smooth, lw=1.6 if optimizer == "muon" or tag else 0.9,
                ls="-" if optimizer == "muon" else "--", label=f"{optimizer} lr {lr:g}{tag}")
    ax.set(xlabel="step", ylabel="training loss (nats, mean of 10 steps)", title=title)
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.6))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
