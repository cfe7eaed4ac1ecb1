"""When a step's work starts and ends, on the time line of the device doing it.

A step's `step_time_s` is the time from the end of the previous step - or from this step's
start, when that is later (an evaluation, a save or a log line ran between) - to the end of this
step's work. Consecutive steps with nothing between them add up to the wall time between their
ends, whether or not a step is launched before the previous one is read; time spent between
steps is not any step's.

The CPU computes while the host issues, so its marks are the host clock (`time.perf_counter`)
taken when a step's launch begins and ends. On CUDA they are timing events recorded in the
stream at the same two points: the end is when the device finishes the step, not when the host
finished enqueueing it.
"""

from __future__ import annotations

import time

import torch


Mark = "float | torch.cuda.Event"  # a point on the device's time line: host seconds, or a CUDA timing event


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """The time from `start` to `end`; for CUDA events, once `end` has completed."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def step_time(self, start: Mark, end: Mark, previous_end: Mark | None) -> float:
        """From the later of this step's start and the previous step's end to this step's end."""
        own = self.seconds(start, end)
        return own if previous_end is None else min(own, self.seconds(previous_end, end))
