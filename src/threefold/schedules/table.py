"""The table of pipeline schedules: one `ScheduleKind` per schedule (name -> registration), as data.

Each registration names its compute order (orders.py), its refusals, its placement, its chunks
per rank, its picture hints and its planner terms, and - for a schedule that runs differently
from the shared interpreter - the hooks that own its runtime and its training step (`runtime`,
`step`: docs/architecture.md, "How to add a schedule with its own runtime"). Adding a schedule
is adding one entry to `SCHEDULES`. The machinery that reads the table is registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .actions import Action
from .orders import (dualpipev_order, dualpipev_pairs, gpipe_order, interleaved_order, one_f_one_b_order,
                     pipedream_2bw_order, zb_h1_order, zb_v_order)
from .two_bw_timeline import check_request


def _check_2bw(p: int, m: int, v: int) -> str | None:
    try:
        check_request(p, m)
    except ValueError as e:
        return str(e)
    return None


def _one_chunk(fn):
    return lambda p, m, v: [fn(p, m, r) for r in range(p)]


def _check_interleaved(p: int, m: int, v: int) -> str | None:
    if p > 1 and m < p:
        return (f"interleaved needs at least as many micro-batches as pipeline ranks ({m} < {p}); "
                f"raise microbatches to {p} or more")
    return None


def _check_dualpipev(p: int, m: int, v: int) -> str | None:
    if m < 2 * p:
        return (f"dualpipev needs at least as many micro-batches as stages, 2 x pp ({m} < {2 * p}); "
                f"raise microbatches to {2 * p} or more")
    return None


def _v_bubble(p: int, m: int) -> float:
    """zb-v and dualpipev with F = I = W = 1 per rank (1/2 per chunk): a makespan of 3m + (p - 1)/2,
    or with zb-v's m < 2p - 1 (its warm-up not filled) 3m + 2p - 1 - m. The simulator's figures for
    every p, m the schedule accepts (unit/test_schedules.py)."""
    idle = max((p - 1) / 2, 2 * p - 1 - m)
    return idle / (3 * m + idle)


@dataclass(frozen=True)
class ScheduleKind:
    """One pipeline schedule: everything the runtime, validator, simulator, pictures, config and
    planner read about it. Adding a schedule is adding one entry to `SCHEDULES`."""

    name: str
    orders: Callable[[int, int, int], list[list[Action]]]  # (p, m, chunks) -> every rank's compute order
    summary: str  # one line for help texts and docs
    placement: str = "interleaved"  # stage -> rank: "interleaved" (s % p) or "v" (actions.stage_rank)
    chunks: int | None = 1  # model chunks per rank; None: pipeline.virtual_stages decides (interleaved)
    check: Callable[[int, int, int], str | None] = lambda p, m, v: None  # refusal (with the fix), or None
    split_backward: bool = False  # runs I and W (zero-bubble); the pictures then draw both halves
    pairs: Callable[[int, int, int], list] | None = None  # rank -> overlapped (F, B) pairs, or None
    shown_batches: int = 1  # batches one schedule shows (pipedream-2bw: two, without a flush between)
    synchronous: bool = True  # False: weights updated without a flush (the planner never picks it)
    # planner: bubble share of the makespan with F = I = W = 1 per stage (all chunks together)
    bubble: Callable[[int, int, int], float] = lambda p, m, v: (p - 1) / (m + p - 1)
    preference: int = 9  # planner: of equally good layouts the lower wins (ties go to the simpler schedule)
    # planner: the bubble's time beyond m (F + B) for p stages, v chunks, per-stage costs F, B = I + W
    # and W of a micro-batch; None: from `bubble` (the V schedules) or (p - 1) (F + B)
    bubble_time: Callable[[int, int, int, float, float, float], float] | None = None
    # the schedule's own runtime and training step, for one the shared interpreter and `TrainStep` do
    # not run: "module:name" (pkgutil.resolve_name; imported only when a run uses the schedule) of a
    # pipeline/runtime.py `RuntimeFactory` and of a train/step.py `StepFactory`; None: the shared ones
    runtime: str | None = None
    step: str | None = None

    @property
    def needs_virtual_stages(self) -> bool:
        """Whether `pipeline.virtual_stages` sets its chunks per rank (interleaved)."""
        return self.chunks is None

    def chunks_for(self, virtual_stages: int) -> int:
        """Model chunks per rank given `pipeline.virtual_stages`."""
        return virtual_stages if self.chunks is None else self.chunks


SCHEDULES: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", _one_chunk(gpipe_order), "all forwards, then all backwards", preference=3),
    ScheduleKind("1f1b", _one_chunk(one_f_one_b_order), "one forward, one backward (PipeDream-flush)",
                 preference=0),
    ScheduleKind("interleaved", lambda p, m, v: [interleaved_order(p, m, r, v) for r in range(p)],
                 "Megatron-LM's interleaved 1F1B over pipeline.virtual_stages chunks per rank",
                 chunks=None, check=_check_interleaved,
                 bubble=lambda p, m, v: (p - 1) / (v * m + p - 1), preference=1,
                 bubble_time=lambda p, m, v, f, b, w: (p - 1) * (f + b) / v),
    ScheduleKind("zb-h1", _one_chunk(zb_h1_order), "1F1B with the backward split into I and W, W deferred",
                 split_backward=True, bubble=lambda p, m, v: (p - 1) / (3 * m + p - 1), preference=2,
                 bubble_time=lambda p, m, v, f, b, w: (p - 1) * max(f + b - 2 * w, 0.0)),
    ScheduleKind("zb-v", _one_chunk(zb_v_order), "zero-bubble V: two chunks per rank in a V, I and W split",
                 placement="v", chunks=2, split_backward=True, bubble=lambda p, m, v: _v_bubble(p, m)),
    ScheduleKind("dualpipev", _one_chunk(dualpipev_order),
                 "DualPipeV: two chunks per rank in a V, one micro-batch's forward paired with another's backward",
                 placement="v", chunks=2, check=_check_dualpipev, split_backward=True,
                 pairs=dualpipev_pairs, bubble=lambda p, m, v: _v_bubble(p, m)),
    ScheduleKind("pipedream-2bw", _one_chunk(pipedream_2bw_order),
                 "PipeDream-2BW: 1F1B without flush, two weight versions (asynchronous: changes the optimisation)",
                 check=_check_2bw, shown_batches=2, synchronous=False, bubble=lambda p, m, v: 0.0,
                 runtime="threefold.pipeline.two_bw:make_runtime", step="threefold.train.two_bw_step:TwoBWStep"),
)}


DEFAULT_SCHEDULE = "1f1b"  # pipeline.schedule's default
# the schedule whose chunks per rank pipeline.virtual_stages sets
VIRTUAL_SCHEDULE = next(name for name, k in SCHEDULES.items() if k.needs_virtual_stages)


def kind(name: str) -> ScheduleKind:
    """The registration of `name`; ValueError naming the choices for an unknown one."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule '{name}'; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def chunks_per_rank(name: str, virtual_stages: int = 1) -> int:
    """Model chunks each pp rank holds under schedule `name`."""
    return kind(name).chunks_for(virtual_stages)


def check(name: str, p: int, m: int, v: int = 1) -> str | None:
    """Why schedule `name` refuses (p, m, v), with the fix, or None."""
    k = kind(name)
    if p < 1 or m < 1 or v < 1:
        return f"pp, microbatches and virtual stages must be at least 1 (got {p}, {m}, {v})"
    if k.chunks is not None and v not in (1, k.chunks):
        return (f"schedule '{name}' runs {k.chunks} chunk{'s' if k.chunks > 1 else ''} per rank; "
                + (f"virtual stages need '{VIRTUAL_SCHEDULE}'" if k.chunks == 1 else "leave virtual stages at 1"))
    return k.check(p, m, k.chunks_for(v))

