"""A timeline: what each pipeline rank did when, simulated or measured, and its bubble.

The simulator and the runtime both produce a list of `Event`s; the pictures, the Chrome trace
and the bubble figures read only that, so a measured run and its simulation compare directly.
"""

from __future__ import annotations

from typing import NamedTuple

COMPUTE_KINDS = ("F", "B", "I", "W")


class Event(NamedTuple):
    rank: int
    kind: str  # F, B, I, W (compute) or SEND_F, RECV_F, SEND_B, RECV_B (posting a transfer)
    stage: int
    mb: int
    start: float  # seconds (measured) or cost units (simulated), from the start of the step
    end: float


def makespan(events: list[Event]) -> float:
    """From the first start to the last end over all ranks."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def _union(intervals) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def busy_time(events: list[Event], rank: int) -> float:
    """The time the rank computed: the union of its compute events (dualpipev's overlapped pairs
    run two at once)."""
    return _union((e.start, e.end) for e in events if e.rank == rank and e.kind in COMPUTE_KINDS)


def busy_times(events: list[Event], pp: int) -> list[float]:
    """`busy_time` of every rank, in one pass over the events."""
    per_rank: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    for e in events:
        if e.kind in COMPUTE_KINDS:
            per_rank[e.rank].append((e.start, e.end))
    return [_union(intervals) for intervals in per_rank]


def bubble_fractions(events: list[Event], pp: int, busy: list[float] | None = None) -> list[float]:
    """Per rank: the share of the step's makespan the rank spent not computing (`busy`: the ranks'
    `busy_times`, when known)."""
    total = makespan(events)
    if total <= 0:
        return [0.0] * pp
    return [1.0 - b / total for b in (busy if busy is not None else busy_times(events, pp))]


def peak_in_flight(events: list[Event], pp: int) -> list[int]:
    """Per rank: the most (stage, micro-batch) pairs whose activations were held at once.

    Activations are held from F until the last backward piece of that pair (B, or W when the
    backward is split), in the order the rank ran its actions.
    """
    split = {(e.stage, e.mb) for e in events if e.kind == "W"}
    per_rank: list[list[Event]] = [[] for _ in range(pp)]
    for e in events:
        per_rank[e.rank].append(e)
    peaks = []
    for mine in per_rank:
        held = peak = 0
        for e in sorted(mine, key=lambda e: (e.start, e.end)):
            if e.kind == "F":
                held += 1
                peak = max(peak, held)
            elif e.kind == "W" or (e.kind in ("B", "I") and (e.stage, e.mb) not in split):
                held -= 1
        peaks.append(peak)
    return peaks
