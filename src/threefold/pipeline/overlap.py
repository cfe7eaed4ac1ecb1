"""How much of the expert exchanges' time the schedule kept off the critical path.

Every exchange of the paired dispatch (pipeline/expert_overlap.py) logs whether the turn passed
to the other side of its pair while it was in flight (`switched`: the schedule's fact, counted),
when it was posted (the issuing call returned: the transfers are under way), when its caller
began to wait for it and when it completed (the clock's figures, which a bench reports). Between
posting and waiting the rank did something else (the other side of a dualpipev pair computed);
from the wait to completion it waited, exposed:

    in flight = end - posted
    hidden    = min(wait, end) - posted      (0 when it is waited where it is posted)
    exposed   = in flight - hidden

`fraction` = hidden / in flight, summed over the exchanges counted: those issued inside the
overlapped pairs, or every exchange of the steps (`PipelineRuntime.pair_overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tally:
    """Exchanges, how many the other side computed beside, their seconds in flight and the seconds
    of that hidden, summed."""

    exchanges: int = 0
    switched: int = 0
    in_flight_s: float = 0.0
    hidden_s: float = 0.0

    def add(self, switched: bool, posted: float, wait: float, end: float) -> None:
        self.exchanges += 1
        self.switched += bool(switched)
        self.in_flight_s += end - posted
        self.hidden_s += max(0.0, min(wait, end) - posted)

    @property
    def fraction(self) -> float:
        return self.hidden_s / self.in_flight_s if self.in_flight_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"exchanges": self.exchanges, "switched": self.switched, "in_flight_s": self.in_flight_s,
                "hidden_s": self.hidden_s, "fraction": self.fraction}
