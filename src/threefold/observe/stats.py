"""Per-rank step statistics: where each rank's step time went, and who holds the others up.

Each rank measures, from its flight record, the time its main thread was *blocked* in
collectives during the step (a blocking call from issue to end, an asynchronous one from
`wait()` to end; communication that overlaps computation costs nothing and is not counted).
The rest of the step is *compute* (forward, backward, optimizer, data, Python). One small
all-gather over every mesh axis (`gather_world`, filed as "all_gather.stats") gives every rank
every rank's figures; then, per rank:

    compute = step - blocked
    idle    = min(blocked, max over ranks of compute - compute)   waiting for the slowest rank
    comm    = blocked - idle                                        moving data

In a synchronous step every rank finishes together, so a rank that computes less waits for the
slowest one inside some collective: that wait is idle time, not communication. A *straggler* is
the rank with the largest compute time when it exceeds `ratio` x the median (per step, and over
the run from the per-rank medians).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from ..comm import Comm

def gather_world(comm: Comm, row: torch.Tensor, tag: str = "stats") -> torch.Tensor:
    """Every rank's `row` (1-D), as (world_size, len) in global-rank order, on every rank.

    All-gathers over every axis, innermost first: the mesh's axis order (pp, dp, cp, tp) makes the
    result global-rank order. Trivial axes cost nothing.
    """
    mesh = comm.mesh
    table = row.reshape(1, -1)
    for axis in reversed(mesh.axis_names):
        n = mesh.size(axis)
        if n > 1:
            out = torch.empty((n * table.shape[0], table.shape[1]), dtype=table.dtype, device=table.device)
            comm.all_gather(out, table.contiguous(), axis, tag=tag)
            table = out
    return table


def blocked_seconds(records, since_seq: int) -> float:
    """Time the caller spent blocked in the collectives issued after `since_seq`."""
    total = 0.0
    for r in reversed(records):
        if r.seq <= since_seq:
            break
        if r.end is not None:
            total += r.end - (r.wait if r.wait is not None else r.start)
    return total


def split_step(step_s: list[float], blocked_s: list[float]) -> dict[str, list[float]]:
    """Per-rank compute / comm / idle seconds from step and blocked times (see the module doc)."""
    compute = [max(0.0, s - b) for s, b in zip(step_s, blocked_s)]
    slowest = max(compute)
    idle = [min(b, slowest - c) for b, c in zip(blocked_s, compute)]
    comm = [b - i for b, i in zip(blocked_s, idle)]
    return {"step_s": list(step_s), "compute_s": compute, "comm_s": comm, "idle_s": idle}


def straggler(compute_s: list[float], ratio: float) -> int | None:
    """The rank whose compute time exceeds `ratio` x the median, if any (the slowest such)."""
    if len(compute_s) < 2:
        return None
    median = statistics.median(compute_s)
    slowest = max(range(len(compute_s)), key=compute_s.__getitem__)
    return slowest if compute_s[slowest] > ratio * median else None


@dataclass
class RunStats:
    """Per-rank figures over the run, for the summary and its straggler verdict."""

    ratio: float
    compute: list[list[float]] = field(default_factory=list)  # per step, per rank
    comm: list[list[float]] = field(default_factory=list)
    idle: list[list[float]] = field(default_factory=list)
    stragglers: dict[int, int] = field(default_factory=dict)  # rank -> steps flagged

    def add(self, split: dict, flagged: int | None) -> None:
        self.compute.append(split["compute_s"])
        self.comm.append(split["comm_s"])
        self.idle.append(split["idle_s"])
        if flagged is not None:
            self.stragglers[flagged] = self.stragglers.get(flagged, 0) + 1

    def summary(self) -> dict:
        if not self.compute:
            return {}
        ranks = range(len(self.compute[0]))
        med = {name: [statistics.median(step[r] for step in rows) for r in ranks]
               for name, rows in (("compute_s", self.compute), ("comm_s", self.comm), ("idle_s", self.idle))}
        return {"steps": len(self.compute), "median_per_rank": med,
                "straggler": straggler(med["compute_s"], self.ratio),
                "steps_flagged": {str(r): n for r, n in sorted(self.stragglers.items())},
                "straggler_ratio": self.ratio}
