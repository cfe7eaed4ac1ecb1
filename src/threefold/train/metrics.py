"""What a run reports: metrics.jsonl, a progress bar, TensorBoard (optional); plots are in observe/plots.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..observe.plots import plot_run, read_metrics

if TYPE_CHECKING:  # read_metrics' users (bench/) load this module without torch
    from ..comm.collectives import Handle
    from .step import Device, Figure

__all__ = ["MetricsLog", "PostedRead", "plot_run", "read_metrics"]


class PostedRead:
    """A step's figures behind a posted (asynchronous) reduction: `values()` waits for it, then reads
    them as `step.start_read` does. pipedream-2bw's metrics reduction over pp is posted at the end of
    a step and waited for when the step's record is made, after the next step is launched (the
    trainer's `_post_figures`), so no pipeline rank waits for another at the step boundary.

    `figures()` builds the figures from the reduced tensors: called after the wait (on CUDA the
    wait orders the stream, so what it computes follows the reduction)."""

    def __init__(self, posted: Handle, figures: Callable[[], dict[str, Figure]], device: Device):
        self._posted, self._figures, self._device = posted, figures, device

    def values(self) -> dict[str, float]:
        from .step import start_read

        self._posted.wait()
        return start_read(self._figures(), self._device).values()


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
