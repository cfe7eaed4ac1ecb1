"""Event simulation of a schedule with given costs: makespan, bubble per rank, peak activations.

The simulation is `schedules.replay` (the runtime's exact rules) with durations: F, I and W
cost what `Costs` says (a full backward B costs I + W), sends and receive postings cost no
rank time, and a message arrives `comm` after it is sent. With equal unit costs it gives the
textbook bubbles: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved, and for
ZB-H1 a bubble time of (p-1)(F+I-W) instead of 1F1B's (p-1)(F+I+W).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..schedules.actions import Action, Schedule
from ..schedules.replay import replay
from .timeline import Event, bubble_fractions, busy_times, makespan, peak_in_flight


@dataclass(frozen=True)
class Costs:
    """Time of one action of one stage (chunk), in any unit (seconds, or 1 = one forward)."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0  # latency of one activation / gradient message

    def duration(self, a: Action) -> float:
        if a.kind == "F":
            return self.forward
        if a.kind == "I":
            return self.backward_input
        if a.kind == "W":
            return self.backward_weight
        if a.kind == "B":
            return self.backward_input + self.backward_weight
        return 0.0


@dataclass
class Simulation:
    schedule: Schedule
    events: list[Event]
    makespan: float
    busy: list[float]  # compute time per rank
    bubble: list[float]  # idle share of the makespan per rank
    peak_activations: list[int]  # most (stage, micro-batch) pairs held at once per rank

    @property
    def bubble_time(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    def summary(self) -> str:
        s = self.schedule
        worst = max(self.bubble)
        return (f"{s.name}: pp={s.pp} microbatches={s.microbatches} virtual={s.virtual}  makespan={self.makespan:g}  "
                f"bubble={worst:.1%} (max over ranks)  peak activations per rank={self.peak_activations}")


def simulate(schedule: Schedule, costs: Costs | None = None,
             duration: Callable[[Action], float] | None = None) -> Simulation:
    """Run `schedule` with `costs` (or a custom per-action `duration`); raises ScheduleError on deadlock."""
    costs = costs or Costs()
    run = replay(schedule, duration or costs.duration, costs.comm)
    events = [Event(r, a.kind, a.stage, a.mb, start, end)
              for r, (actions, times) in enumerate(zip(schedule.ranks, run.times))
              for a, (start, end) in zip(actions, times)]
    p = schedule.pp
    busy = busy_times(events, p)
    return Simulation(schedule, events, makespan(events), busy, bubble_fractions(events, p, busy),
                      peak_in_flight(events, p))
