"""How much of an overlapped pair's all-to-all time the other side's computation hid.

dualpipev runs a forward and a backward at once (pipeline/runtime.py); each side issues the
expert all-to-alls of its blocks. For one pair, with each side's span (its action, host clock)
and the spans its all-to-alls were in flight (issue to completion, `Comm`'s records):

    computing(X) = span(X) minus the union of X's all-to-alls   (X is neither waiting nor idle)
    hidden       = |a2a(F) & computing(B)| + |a2a(B) & computing(F)|
    in flight    = |a2a(F)| + |a2a(B)|

`fraction` = hidden / in flight over every pair: the share of the paired all-to-all time during
which the other micro-batch computed. Without the pairing (the two back to back) it is 0 by
construction: the other side's span does not meet this side's all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Span = tuple[float, float]


def union(spans: list[Span]) -> list[Span]:
    """The spans merged: disjoint, sorted."""
    out: list[list[float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(spans: list[Span]) -> float:
    return sum(b - a for a, b in union(spans))


def intersect(xs: list[Span], ys: list[Span]) -> list[Span]:
    """Where both unions cover."""
    out, ys = [], union(ys)
    for a, b in union(xs):
        out += [(max(a, c), min(b, d)) for c, d in ys if max(a, c) < min(b, d)]
    return out


def minus(span: Span, holes: list[Span]) -> list[Span]:
    """`span` without the holes."""
    out, at = [], span[0]
    for a, b in union(holes):
        if a > at:
            out.append((at, min(a, span[1])))
        at = max(at, b)
    if at < span[1]:
        out.append((at, span[1]))
    return [s for s in out if s[1] > s[0]]


@dataclass
class PairTimes:
    """One overlapped pair: each side's span and its all-to-alls' spans (host clock, seconds)."""

    forward: Span
    backward: Span
    forward_comm: list[Span] = field(default_factory=list)
    backward_comm: list[Span] = field(default_factory=list)

    def in_flight(self) -> float:
        return length(self.forward_comm) + length(self.backward_comm)

    def hidden(self) -> float:
        computing_f = minus(self.forward, self.forward_comm)
        computing_b = minus(self.backward, self.backward_comm)
        return length(intersect(self.forward_comm, computing_b)) + length(intersect(self.backward_comm, computing_f))


@dataclass
class Tally:
    """Pairs, all-to-all seconds in flight and seconds hidden, summed."""

    pairs: int = 0
    in_flight_s: float = 0.0
    hidden_s: float = 0.0

    def add(self, pair: PairTimes) -> None:
        self.pairs += 1
        self.in_flight_s += pair.in_flight()
        self.hidden_s += pair.hidden()

    @property
    def fraction(self) -> float:
        return self.hidden_s / self.in_flight_s if self.in_flight_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"pairs": self.pairs, "in_flight_s": self.in_flight_s, "hidden_s": self.hidden_s,
                "fraction": self.fraction}
