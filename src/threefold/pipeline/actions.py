"""The vocabulary of pipeline schedules: actions and per-rank action lists (see schedules.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ValueError):
    """A schedule is incomplete, mismatched or deadlocks; the message names the culprit."""


class Action(NamedTuple):
    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int
    ranks: tuple[tuple[Action, ...], ...]  # rank -> ordered actions

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stage_rank(self, stage: int) -> int:
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [c * self.pp + rank for c in range(self.virtual)]
