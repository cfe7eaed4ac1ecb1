"""What `Comm` (comm/collectives.py) hands out and keeps: the flight record of one call
(`CollectiveRecord`), the handle of a pending operation (`Handle`, with `_Shared`: one Work waited
once by whichever handle asks first, and `AllOf`: several as one), and the bytes sent per axis and op
(`Traffic`, with `ring_chunk`: the split the byte counts of a ring assume)."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class CollectiveRecord:
    seq: int
    op: str
    axis: str
    shape: tuple
    dtype: str
    bytes: int
    callsite: str
    start: float  # time.monotonic() when issued
    end: float | None = None  # None while in flight
    group: tuple = ()  # global ranks of the group, in coordinate order
    axis_seq: int = 0  # 1-based index of this call among this rank's calls on `axis`
    wait: float | None = None  # when the caller started to block on it (== start for blocking calls)
    peer: int | None = None  # send / recv: the other side's global rank
    lane: str = ""  # the axis's second group it ran on (Mesh.add_lane); "" for the axis's own
    # after wait() returned: a callable telling whether the op has completed (CUDA event), or None
    probe: object = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out.pop("probe", None)
        return out

    def poll(self) -> bool:
        """Whether the op has completed; stamps `end` the first time it is seen complete."""
        probe = self.probe  # one read: the watchdog thread polls too
        if self.end is None and probe is not None and probe():
            self.end = time.monotonic()
            self.probe = None
        return self.end is not None


def _cuda_probe(work=None):
    """An event after the op on the current stream (wait() made the stream wait for it)."""
    event = torch.cuda.Event()
    event.record()
    return event.query


class Handle:
    """A pending asynchronous operation; `wait()` blocks until it is done and stamps its record.

    Several handles may share one Work (a coalesced p2p batch): the first `wait()` waits for it.
    `completion(work)` gives the record's completion probe after the wait (None: complete now).
    """

    def __init__(self, work, record: CollectiveRecord | None, completion=None):
        self._work = work if isinstance(work, _Shared) or work is None else _Shared(work)
        self.record = record
        self._completion = completion

    def wait(self) -> None:
        record = self.record
        if record is not None and record.wait is None:
            record.wait = time.monotonic()
        work = self._work
        if work is not None:
            work.wait()
            self._work = None
        if record is not None and record.end is None and record.probe is None:
            probe = self._completion(work.work) if self._completion is not None and work is not None else None
            if probe is None:
                record.end = time.monotonic()
            else:
                record.probe = probe
                record.poll()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class _Shared:
    """One Work, waited once by whichever of its handles asks first; a handle asking meanwhile (from
    another thread: a dualpipev pair's forward and backward may each wait for a receive of one
    batch, which NCCL, and the nccl test mode, complete as one Work) waits for that wait to end.
    gloo's point-to-point Work never returns from a second wait()."""

    def __init__(self, work):
        self.work = work
        self._waited = False
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            if not self._waited:
                self.work.wait()
                self._waited = True

    def is_completed(self) -> bool:
        return self._waited or self.work.is_completed()


class AllOf:
    """Several Works or handles as one: complete when all of them are (NCCL's one Work per batch in
    the test mode, a coalesced all-gather's works, a bucket's per-segment reduce-scatters)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


@dataclass
class Traffic:
    """Bytes sent by this rank: {axis: {op: bytes}}, in total and in the current window."""

    total: dict = field(default_factory=lambda: collections.defaultdict(lambda: collections.defaultdict(int)))
    window: dict = field(default_factory=lambda: collections.defaultdict(lambda: collections.defaultdict(int)))

    def add(self, axis: str, op: str, nbytes: int) -> None:
        self.total[axis][op] += nbytes
        self.window[axis][op] += nbytes

    def take_window(self) -> dict:
        """Bytes since the previous call, as plain dicts; starts a new window."""
        out = {axis: dict(ops) for axis, ops in self.window.items()}
        self.window.clear()
        return out

    def window_bytes(self, axis: str | None = None, op: str | None = None) -> int:
        return _sum(self.window, axis, op)

    def total_bytes(self, axis: str | None = None, op: str | None = None) -> int:
        return _sum(self.total, axis, op)


def _sum(table: dict, axis: str | None, op: str | None) -> int:
    return sum(n for a, ops in table.items() if axis in (None, a) for o, n in ops.items() if op in (None, o))


def ring_chunk(numel: int, n: int, index: int) -> int:
    """Elements of chunk `index` when `numel` elements are split into `n` ring chunks."""
    q, r = divmod(numel, n)
    return q + (1 if index < r else 0)
