"""The execution rules every reader of a schedule agrees on, as a fast event-driven replay.

Each rank runs its list in order; sends and receive postings never block; a compute action
starts when its rank is free and its input exists (a local hand-off, or a message that was
sent and whose receive was posted). `replay` applies these rules with optional durations:
with none it proves termination (the validator), with costs it is the simulator.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

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
    ranks = s.ranks
    pc = [0] * s.pp
    clock = [0.0] * s.pp
    times: list[list[tuple[float, float]]] = [[] for _ in range(s.pp)]
    events: dict[tuple, float] = {}
    channel_last: dict[tuple[int, int], float] = defaultdict(float)
    waiting: dict[tuple, list[int]] = defaultdict(list)
    runnable = deque(range(s.pp))

    def produce(key, t):
        events[key] = t
        runnable.extend(waiting.pop(key, ()))

    while runnable:
        r = runnable.popleft()
        actions = ranks[r]
        while pc[r] < len(actions):
            a = actions[pc[r]]
            needs = _needs(a, r, s)
            missing = next((k for k in needs if k not in events), None)
            if missing is not None:
                waiting[missing].append(r)
                break
            start = max([clock[r]] + [events[k] for k in needs])
            end = start + duration(a)
            clock[r] = end
            times[r].append((start, end))
            pc[r] += 1
            kind = a.kind
            if kind == "F":
                produce(("F", a.stage, a.mb), end)
            elif kind in ("B", "I"):
                produce(("Bin", a.stage, a.mb), end)
            elif kind in ("SEND_F", "SEND_B"):
                dst_stage = a.stage + 1 if kind == "SEND_F" else a.stage - 1
                channel = (r, s.stage_rank(dst_stage))
                arrival = max(end + latency, channel_last[channel])
                channel_last[channel] = arrival
                produce(("arrived", "act" if kind == "SEND_F" else "grad", a.stage, a.mb), arrival)
            elif kind == "RECV_F":
                produce(("posted", "act", a.stage - 1, a.mb), end)
            elif kind == "RECV_B":
                produce(("posted", "grad", a.stage + 1, a.mb), end)
    stuck = [f"rank {r} waits at {ranks[r][pc[r]]}" for r in range(s.pp) if pc[r] < len(ranks[r])]
    if stuck:
        raise ScheduleError(f"{s.name} (pp={s.pp}, m={s.microbatches}, v={s.virtual}) deadlocks: "
                            + "; ".join(stuck))
    return Replay(s, times)
