"""The vocabulary of pipeline schedules: actions and per-rank action lists (see registry.py)."""

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


PLACEMENTS = ("interleaved", "v")


def stage_rank(placement: str, p: int, stage: int) -> int:
    """The pp rank stage `stage` runs on. "interleaved" (Megatron-LM): s % p, chunk s // p.
    "v" (two chunks per rank, the second running back up the pipeline): rank r holds stages r and
    2p - 1 - r, so the last stage sits on rank 0 next to the first."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def stages_of(placement: str, p: int, v: int, rank: int) -> list[int]:
    """The stages rank `rank` holds, in chunk order (chunk c = stage // p under both placements)."""
    if placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int
    ranks: tuple[tuple[Action, ...], ...]  # rank -> ordered actions
    placement: str = "interleaved"  # stage -> rank (`stage_rank`)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stage_rank(self, stage: int) -> int:
        return stage_rank(self.placement, self.pp, stage)

    def stages_of(self, rank: int) -> list[int]:
        return stages_of(self.placement, self.pp, self.virtual, rank)
