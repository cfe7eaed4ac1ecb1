"""What a run reports: metrics.jsonl, a progress bar, TensorBoard (optional), a loss plot."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


class MetricsLog:
    """One JSON object per optimizer step in DIR/metrics.jsonl (written by one rank)."""

    def __init__(self, out: Path, progress: bool, tensorboard: bool, total_steps: int, first_step: int = 1):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        mode = "a" if first_step > 1 and self.path.exists() else "w"
        self._file = self.path.open(mode)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step - 1, desc="train", unit="step",
                             dynamic_ncols=True, mininterval=0.5)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("run.tensorboard: the tensorboard package is not installed; "
                                "pip install tensorboard") from None
            self._tb = SummaryWriter(str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                self._tb.add_scalar(key, record[key], record["step"])

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_run(metrics_path: Path, png: Path) -> Path:
    """Loss and throughput over the steps of a run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens / s", title="throughput")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
