"""PNG plots of a run from its DIR/metrics.jsonl: loss, throughput, memory, per-rank time.

    loss.png         training loss (and gradient norm) per step, validation loss where evaluated
    throughput.png   tokens / s per step
    memory.png       bytes held by the writing rank: parameters, gradients, optimizer, activations, peak
    ranks.png        per-rank median compute / communication / idle seconds per step (debug.stats)
    expert_load.png  mixtures of experts: tokens per expert (min, mean, max over every sparse
                     block's experts) per step, the max / mean imbalance, and the dropped tokens
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(metrics_path: Path, out: Path) -> list[Path]:
    """Write the PNGs above into the directory `out`; returns their paths."""
    plt = _pyplot()
    rows = read_metrics(metrics_path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in rows], label="loss")
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]  # train.eval_every
    if val:
        ax.plot(*zip(*val), marker="o", color="tab:orange", label="validation loss")
        ax.set_title("training and validation loss")
        ax.legend(loc="upper right")
    if all("grad_norm" in r for r in rows):
        twin = ax.twinx()
        twin.plot(steps, [r["grad_norm"] for r in rows], color="tab:gray", alpha=0.5, linewidth=1)
        twin.set_ylabel("gradient norm", color="tab:gray")
    written.append(_save(plt, fig, out / "loss.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput")
    written.append(_save(plt, fig, out / "throughput.png"))

    if all("mem" in r for r in rows) and rows:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in rows[0]["mem"]:
            ax.plot(steps, [r["mem"][key] / 2**20 for r in rows], label=key)
        ax.set(xlabel="step", ylabel="MiB", title="memory (writing rank)")
        ax.legend(fontsize="small")
        written.append(_save(plt, fig, out / "memory.png"))

    ranked = [r["ranks"] for r in rows if "ranks" in r]
    if ranked:
        n = len(ranked[0]["compute_s"])
        fig, ax = plt.subplots(figsize=(max(4, 0.6 * n + 2), 3.5))
        bottom = [0.0] * n
        for key, colour in (("compute_s", "tab:blue"), ("comm_s", "tab:orange"), ("idle_s", "tab:red")):
            values = [statistics.median(step[key][r] for step in ranked) for r in range(n)]
            ax.bar(range(n), values, bottom=bottom, label=key[:-2], color=colour)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(xlabel="rank", ylabel="seconds per step (median)", title="where each rank's step goes")
        ax.set_xticks(range(n))
        ax.legend(fontsize="small")
        written.append(_save(plt, fig, out / "ranks.png"))
    if any("moe" in r for r in rows):
        written.append(plot_expert_load(rows, out / "expert_load.png"))
    return written


def plot_expert_load(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    return _save(plt, expert_load_figure(rows), Path(path))


def expert_load_figure(rows: list[dict]):
    """Expert load over training from the `moe` field of metrics rows: the band of tokens per expert
    between the least and the most loaded expert, the mean (perfect balance), the imbalance max /
    mean on a second axis, and the assignments dropped by the capacity where any were."""
    plt = _pyplot()
    rows = [r for r in rows if "moe" in r]
    steps = [r["step"] for r in rows]
    load = [r["moe"]["tokens_per_expert"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.fill_between(steps, [x["min"] for x in load], [x["max"] for x in load], alpha=0.3, color="tab:blue",
                    label="min - max")
    ax.plot(steps, [x["mean"] for x in load], color="tab:blue", label="mean")
    dropped = [r["moe"]["dropped"] for r in rows]
    if any(dropped):
        ax.plot(steps, dropped, color="tab:red", linewidth=1, label="dropped")
    ax.set(xlabel="step", ylabel="tokens per expert (per step)", title="expert load")
    ax.legend(loc="upper left", fontsize="small")
    twin = ax.twinx()
    twin.plot(steps, [x["max"] / x["mean"] if x["mean"] else 0.0 for x in load], color="tab:gray", linewidth=1)
    twin.set_ylabel("max / mean", color="tab:gray")
    _integer_steps(fig)
    return fig


def _integer_steps(fig) -> None:
    """Steps are whole numbers: no axis over steps gets a tick at 1.5."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(plt, fig, path: Path) -> Path:
    _integer_steps(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
