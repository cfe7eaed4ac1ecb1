"""The execution rules every reader of a schedule agrees on, as a fast event-driven replay.

Each rank runs its list in order; sends and receive postings never block; a compute action
starts when its rank is free and its input exists (a local hand-off, or a message that was
sent and whose receive was posted). `replay` applies these rules with optional durations:
with none it proves termination (the validator), with costs it is the simulator.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Iterator

from .actions import Action, Schedule, ScheduleError

def _needs(a: Action, rank: int, s: Schedule) -> list[tuple]:
    """Events that must have happened before action `a` can start on `rank`."""
    last = s.num_stages - 1
    if a.kind == "F":
        if a.stage == 0:
            return []
        if s.stage_rank(a.stage - 1) == rank:
            return [("F", a.stage - 1, a.mb)]
        return [("posted", "act", a.stage - 1, a.mb), ("arrived", "act", a.stage - 1, a.mb)]
    if a.kind in ("B", "I"):
        need = [("F", a.stage, a.mb)]
        if a.stage == last:
            return need
        if s.stage_rank(a.stage + 1) == rank:
            return need + [("Bin", a.stage + 1, a.mb)]
        return need + [("posted", "grad", a.stage + 1, a.mb), ("arrived", "grad", a.stage + 1, a.mb)]
    if a.kind == "W":
        return [("Bin", a.stage, a.mb)]
    if a.kind == "SEND_F":
        return [("F", a.stage, a.mb)]
    if a.kind == "SEND_B":
        return [("Bin", a.stage, a.mb)]
    return []  # receive postings never wait


def _produces(a: Action) -> tuple | None:
    """The event action `a` makes happen (what a later `_needs` names), or None."""
    if a.kind == "F":
        return ("F", a.stage, a.mb)
    if a.kind in ("B", "I"):
        return ("Bin", a.stage, a.mb)
    if a.kind in ("SEND_F", "SEND_B"):
        return ("arrived", "act" if a.kind == "SEND_F" else "grad", a.stage, a.mb)
    if a.kind == "RECV_F":
        return ("posted", "act", a.stage - 1, a.mb)
    if a.kind == "RECV_B":
        return ("posted", "grad", a.stage + 1, a.mb)
    return None


def walk(s: Schedule) -> Iterator[tuple[int, Action, list[tuple], tuple | None]]:
    """(rank, action, the events it needs, the event it makes or None) in the order the replay runs them:
    ranks in turn, each until an action needs an event not yet made. Whether an action can run depends on
    which events exist, never on when: every reader of the schedule (the replay, planner/makespan.py) walks
    it in this one order. Raises ScheduleError on a deadlock."""
    ranks = s.ranks
    pc = [0] * s.pp
    made: set[tuple] = set()
    waiting: dict[tuple, list[int]] = defaultdict(list)
    runnable = deque(range(s.pp))
    while runnable:
        r = runnable.popleft()
        actions = ranks[r]
        while pc[r] < len(actions):
            a = actions[pc[r]]
            needs = _needs(a, r, s)
            missing = next((k for k in needs if k not in made), None)
            if missing is not None:
                waiting[missing].append(r)
                break
            key = _produces(a)
            yield r, a, needs, key
            pc[r] += 1
            if key is not None:
                made.add(key)
                runnable.extend(waiting.pop(key, ()))
    stuck = [f"rank {r} waits at {ranks[r][pc[r]]}" for r in range(s.pp) if pc[r] < len(ranks[r])]
    if stuck:
        raise ScheduleError(f"{s.name} (pp={s.pp}, m={s.microbatches}, v={s.virtual}) deadlocks: "
                            + "; ".join(stuck))


@dataclass
class Replay:
    """Start and end time of every action (rank -> list aligned with the schedule)."""

    schedule: Schedule
    times: list[list[tuple[float, float]]]

    @property
    def makespan(self) -> float:
        return max((t[-1][1] for t in self.times if t), default=0.0)


def replay(s: Schedule, duration: Callable[[Action], float] = lambda a: 0.0,
           latency: float = 0.0) -> Replay:
    """Execute the schedule under the runtime's rules; raise ScheduleError on a deadlock.

    Each rank runs its list in order; an action starts when the rank is free and its inputs
    exist. A message sent at t arrives at t + latency, never before an earlier message of the
    same channel (FIFO). Event-driven: each action is visited once, so it is fast for large p, m.
    """
    clock = [0.0] * s.pp
    times: list[list[tuple[float, float]]] = [[] for _ in range(s.pp)]
    events: dict[tuple, float] = {}
    channel_last: dict[tuple[int, int], float] = defaultdict(float)
    for r, a, needs, key in walk(s):
        start = max([clock[r]] + [events[k] for k in needs])
        end = start + duration(a)
        clock[r] = end
        times[r].append((start, end))
        if a.kind in ("SEND_F", "SEND_B"):
            channel = (r, s.stage_rank(a.stage + 1 if a.kind == "SEND_F" else a.stage - 1))
            end = channel_last[channel] = max(end + latency, channel_last[channel])  # the arrival
        if key is not None:
            events[key] = end
    return Replay(s, times)
