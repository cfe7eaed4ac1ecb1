"""What the convergence benches share: train one configuration on every rank, the final loss,
the loss curves.

local_sgd.py, compression.py and zero_quantized.py each train the same model several ways in
one `World` and compare the curves; this module holds the parts that do not differ. The benches
import it from beside them (`python bench/X.py` puts bench/ on the path, and the World's spawned
processes inherit that path).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def add_run_args(parser: argparse.ArgumentParser, steps: int, global_batch: int, window: int) -> None:
    """The options every convergence bench has: run length, processes, model, batch, AdamW lr, window."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=global_batch)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--window", type=int, default=window, help="final loss: mean of this many last steps")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra config overrides")


def base_overrides(args: argparse.Namespace, *settings: str) -> list[str]:
    """The settings every run of a bench shares, then the bench's own `settings`, then --set's (which win)."""
    return [f"model.preset={args.model}", f"train.steps={args.steps}", f"train.global_batch={args.global_batch}",
            f"train.seq_len={args.seq_len}", f"train.warmup_steps={args.steps // 20}", "data.source=stdlib",
            *settings, *args.extra]


def model_bytes(comm: dict, axis: str) -> int:
    """The model bytes one step's `comm` record sent over `axis` (tagged bookkeeping ops left out)."""
    return sum(n for op, n in comm.get(axis, {}).items() if "." not in op)


def train_one(overrides: list[str], out: str, axes: tuple[str, ...] = ("dp",), local_world_size: int = 0) -> dict:
    """On every rank: train; return the losses, the seconds and this rank's model bytes per step and axis.

    local_world_size > 0 makes the world look like nodes of that many processes (hpZ's dp_intra)."""
    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size or os.environ.get("WORLD_SIZE", 1))
    cfg = load_config(None, [f"run.out={out}", "run.progress=false", "run.plot=false", *overrides])
    start = time.perf_counter()
    records = Trainer(cfg).run()
    return {"losses": [r["loss"] for r in records], "seconds": time.perf_counter() - start,
            "bytes": {axis: [model_bytes(r["comm"], axis) for r in records] for axis in axes}}


def final(losses: list[float], window: int) -> float:
    """The final loss: the mean of the last `window` steps."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def done(name: str, res: dict, window: int) -> None:
    """The progress line of one finished run."""
    print(f"  {name}: {res['seconds']:.0f} s, final loss {final(res['losses'], window):.4f}", flush=True)


def smooth(losses: list[float], n: int = 10) -> list[float]:
    """The running mean of the last n steps (fewer at the start)."""
    return [sum(losses[max(0, i - n + 1): i + 1]) / len(losses[max(0, i - n + 1): i + 1]) for i in range(len(losses))]


def plot(panels: dict[str, dict], path: Path, style, suptitle: str = "") -> None:
    """One panel per title, each the 10-step mean loss curves of its runs; style(name, res) gives plot keywords."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels) if len(panels) > 1 else 9, 6),
                             sharey=True, squeeze=False)
    for ax, (title, results) in zip(axes[0], panels.items()):
        for name, res in results.items():
            losses = res["losses"]
            ax.plot(range(1, len(losses) + 1), smooth(losses), **{"label": name, **style(name, res)})
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.set_title(title, fontsize=10)
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
