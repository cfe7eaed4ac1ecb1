"""A pipeline schedule's makespan for many costs: its dependency graph built once, then one pass per cost.

`threefold.pipeline.simulate` replays a schedule (schedules/replay.py) and keeps every event, each rank's busy
time, bubble and peak; the search needs only the makespan, for the same (schedule, p, m, v) at many costs (every
layout of the same pipeline shape with another tp, micro-batch size or checkpointing). The replay's rules with the
planner's zero latency are a longest path: an action starts at the latest of its rank's clock and the events it
needs (`schedules.replay._needs`: a local hand-off, or a message sent and its receive posted), a message arrives
when sent, never before the channel's previous one. `graph` walks the schedule once in the replay's order (`schedules.replay.walk`), recording for each action where
its inputs come from; `makespan` walks the graph with the costs, in the replay's order and with its own sums, so
that the figure is the simulator's to the last bit (tests/unit/test_plan_search_speed.py holds them equal).
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from ..schedules.actions import Schedule
from ..schedules.replay import walk  # the runtime's own order and rule of what an action waits for

# what a node's time is read from: its end, or (a send) its message's arrival
END, ARRIVAL = 0, 1
COMPUTE = {"F": 0, "I": 1, "W": 2, "B": 3}  # the kinds with a duration; every other action takes none


def graph(s: Schedule) -> tuple[tuple[int, int, tuple[tuple[int, int], ...], int], ...]:
    """The schedule's actions in the replay's order, each as (kind code or -1, node of the rank's previous action or
    -1, the (node, END/ARRIVAL) its needs are read from, previous send on the same channel or -1 for a send else -2)."""
    last = [-1] * s.pp
    produced: dict[tuple, tuple[int, int]] = {}
    channel_last: dict[tuple[int, int], int] = defaultdict(lambda: -1)
    nodes = []
    for r, a, needs, key in walk(s):
        node, kind, send = len(nodes), a.kind, -2
        if kind in ("SEND_F", "SEND_B"):
            channel = (r, s.stage_rank(a.stage + 1 if kind == "SEND_F" else a.stage - 1))
            send, channel_last[channel] = channel_last[channel], node
        nodes.append((COMPUTE.get(kind, -1), last[r], tuple(produced[k] for k in needs), send))
        last[r] = node
        if key is not None:
            produced[key] = (node, ARRIVAL if send != -2 else END)
    return tuple(nodes)


@lru_cache(maxsize=1024)
def cached_graph(s: Schedule) -> tuple:
    return graph(s)


def makespan(s: Schedule, forward: float, backward_input: float, backward_weight: float) -> float:
    """The simulator's makespan of `s` with these per-chunk costs (pipeline.simulate.Costs, no latency)."""
    durations = (forward, backward_input, backward_weight, backward_input + backward_weight)
    nodes = cached_graph(s)
    end = [0.0] * len(nodes)
    arrival = [0.0] * len(nodes)
    first, latest = None, 0.0
    for i, (kind, prev, needs, send) in enumerate(nodes):
        start = max([end[prev] if prev >= 0 else 0.0] + [end[n] if how == END else arrival[n] for n, how in needs])
        end[i] = finish = start + (durations[kind] if kind >= 0 else 0.0)
        if send != -2:  # a message arrives when sent (latency 0), never before the channel's previous one
            arrival[i] = max(finish + 0.0, arrival[send] if send >= 0 else 0.0)
        first = start if first is None or start < first else first
        latest = finish if finish > latest else latest
    return latest - (first or 0.0) if nodes else 0.0
