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


def busy_time(events: list[Event], rank: int) -> float:
    """The time the rank computed: the union of its compute events (dualpipev's overlapped pairs
    run two at once)."""
    total, reach = 0.0, None
    for start, end in sorted((e.start, e.end) for e in events if e.rank == rank and e.kind in COMPUTE_KINDS):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def bubble_fractions(events: list[Event], pp: int) -> list[float]:
    """Per rank: the share of the step's makespan the rank spent not computing."""
    total = makespan(events)
    if total <= 0:
        return [0.0] * pp
    return [1.0 - busy_time(events, r) / total for r in range(pp)]


def peak_in_flight(events: list[Event], pp: int) -> list[int]:
    """Per rank: the most (stage, micro-batch) pairs whose activations were held at once.

    Activations are held from F until the last backward piece of that pair (B, or W when the
    backward is split), in the order the rank ran its actions.
    """
    split = {(e.stage, e.mb) for e in events if e.kind == "W"}
    peaks = []
    for r in range(pp):
        held = peak = 0
        for e in sorted((e for e in events if e.rank == r), key=lambda e: (e.start, e.end)):
            if e.kind == "F":
                held += 1
                peak = max(peak, held)
            elif e.kind == "W" or (e.kind in ("B", "I") and (e.stage, e.mb) not in split):
                held -= 1
        peaks.append(peak)
    return peaks
