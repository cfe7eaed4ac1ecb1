"""The scaling figure of `threefold plan --scaling`: throughput and efficiency against GPUs."""

from __future__ import annotations

from pathlib import Path


def efficiency_axis_top(points: list[dict]) -> float:
    """The top of the efficiency axis in %: 105, or above the largest value (superlinear scaling
    - the smallest size needing recomputation - gives efficiencies over 100%)."""
    fit = [p for p in points if p["fits"]]
    return max([105.0] + [100 * p[k] * 1.08 for p in fit for k in ("efficiency", "mfu")])


def plot_scaling(points: list[dict], path: str | Path, title: str) -> Path:
    """Predicted tokens/s (with the linear ideal) and per-GPU efficiency, log2 GPU axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = [p for p in points if p["fits"]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_tps, ax_eff) = plt.subplots(1, 2, figsize=(11, 4))
    if fit:
        gpus = [p["gpus"] for p in fit]
        ax_tps.plot(gpus, [p["tokens_per_s"] for p in fit], "o-", label="predicted")
        per_gpu = fit[0]["tokens_per_s"] / fit[0]["gpus"]
        ax_tps.plot(gpus, [per_gpu * g for g in gpus], "--", color="gray", label="linear")
        ax_eff.plot(gpus, [100 * p["efficiency"] for p in fit], "o-", color="tab:green", label="scaling efficiency")
        ax_eff.plot(gpus, [100 * p["mfu"] for p in fit], "s-", color="tab:orange", label="MFU")
    for ax in (ax_tps, ax_eff):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_tps.set_yscale("log")
    ax_tps.set(ylabel="tokens / s", title="throughput")
    ax_eff.set(ylabel="%", ylim=(0, efficiency_axis_top(points)), title="efficiency (tokens/s per GPU vs the smallest size)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
