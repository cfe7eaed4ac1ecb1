"""`checkpoint.save_every = "auto"`: the Young/Daly checkpoint interval from costs measured in the run.

The first save comes after the second step this process runs (its first step carries the
warm-up), or at the last step when that comes first. Every save's stall - the time the training
loop waits for `Checkpointer.save`: the whole write, or the host snapshot with
`checkpoint.async_save` - is timed. After each save the ranks agree on the costs (the largest
rank's mean save stall and median step time, one all-reduce(max) per mesh axis) and
`planner.checkpoint_interval.advise` turns them, with the world's GPUs of `checkpoint.mtbf_hours`
each and `checkpoint.restart_seconds`, into an interval in optimizer steps: the next save is that
many steps after this one (and the last step always saves). The advice is printed when it changes
and written to `DIR/run.json` under "checkpoint_interval".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..config import CheckpointConfig
from ..planner.checkpoint_interval import Advice, advise


class AutoSave:
    """When to save under save_every=auto. `agree` maps this rank's [save_s, step_s] to the
    element-wise maximum over all ranks (so every rank picks the same steps)."""

    def __init__(self, ck: CheckpointConfig, gpus: int, last_step: int, start_step: int,
                 agree: Callable[[list[float]], list[float]]):
        self.mtbf_hours, self.restart_s, self.gpus = ck.mtbf_hours, ck.restart_seconds, gpus
        self.last_step = last_step
        self.next_step = min(last_step, start_step + 2)  # start_step: the steps completed before this process
        self.agree = agree
        self.step_times: list[float] = []
        self.save_times: list[float] = []
        self.advice: Advice | None = None
        self.measured: dict = {}
        self.history: list[tuple[int, int]] = []  # (step saved, steps to the next save)

    def record_step(self, elapsed_s: float) -> None:
        self.step_times.append(elapsed_s)

    def due(self, step: int) -> bool:
        return step >= self.next_step or step == self.last_step

    def after_save(self, step: int, save_s: float) -> Advice | None:
        """Record one save's stall and set the next save step; returns the advice when it changed."""
        self.save_times.append(save_s)
        steady = self.step_times[1:] or self.step_times  # the first step carries the warm-up
        save_s, step_s = self.agree([statistics.fmean(self.save_times), statistics.median(steady)])
        advice = advise(save_s, self.mtbf_hours, self.gpus, self.restart_s, step_s=step_s)
        self.next_step = step + advice.every_steps
        self.history.append((step, advice.every_steps))
        self.measured = {"save_s": save_s, "step_s": step_s, "saves": len(self.save_times),
                         "steps": len(steady), "at_step": step}
        changed = self.advice is None or advice.every_steps != self.advice.every_steps
        self.advice = advice
        return advice if changed else None

    def record(self) -> dict:
        """What run.json keeps: the inputs (measured and given) and the advice."""
        return {"mode": "auto", "mtbf_hours_per_gpu": self.mtbf_hours, "gpus": self.gpus,
                "measured": self.measured, **(self.advice.as_dict() if self.advice else {})}
