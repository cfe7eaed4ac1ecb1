"""What a run reports: metrics.jsonl, a progress bar, TensorBoard, W&B and MLflow (optional, `run.trackers`:
observe/trackers.py); plots are in observe/plots.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..observe.plots import plot_run, read_metrics
from ..observe.trackers import Trackers, chosen
from ..observe.goodput import read_lines
from .summary import results_line

if TYPE_CHECKING:  # read_metrics' users (bench/) load this module without torch
    from ..config import Config

__all__ = ["MetricsLog", "plot_run", "read_metrics"]


class MetricsLog:
    """One JSON object per optimizer step in DIR/metrics.jsonl (written by one rank)."""

    def __init__(self, out: Path, cfg: Config, first_step: int = 1):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.path, self._plot = out, out / "metrics.jsonl", cfg.run.plot
        mode = "a" if first_step > 1 and self.path.exists() else "w"
        self._file = self.path.open(mode)
        self._bar = None
        if cfg.run.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=cfg.train.steps, initial=first_step - 1, desc="train", unit="step",
                             dynamic_ncols=True, mininterval=0.5)
        names = chosen(cfg.run)
        self._tb = None
        if "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("run.tensorboard: the tensorboard package is not installed; "
                                "pip install tensorboard") from None
            self._tb = SummaryWriter(str(out / "tensorboard"))
        self._trackers = Trackers(names, cfg.to_dict(), out)  # W&B, MLflow: each on its own thread

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                self._tb.add_scalar(key, record[key], record["step"])
        self._trackers.log(record)  # queued: a tracker never holds up a step

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._trackers:
            records = read_lines(self.path)  # the whole run, a resumed one's earlier attempts included
            plots = plot_run(self.path, self.out) if self._plot and records else []
            self._trackers.close(run_summary(records), plots)


def run_summary(records: list[dict]) -> dict:
    """What the trackers keep as the run's summary: the end-of-run line and its figures."""
    summary: dict = {"line": results_line(records)}
    if records:
        losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
        time_s = sum(r.get("step_time_s", 0.0) for r in records)
        summary.update(steps=records[-1]["step"], final_loss=losses[-1] if losses else None,
                       best_loss=min(losses) if losses else None,
                       tokens_per_s=sum(r.get("tokens", 0) for r in records) / time_s if time_s > 0 else None)
    return {k: v for k, v in summary.items() if v is not None}
