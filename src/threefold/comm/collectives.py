"""Every collective and point-to-point transfer of threefold goes through `Comm`.

`Comm` wraps torch.distributed on the groups of a `Mesh` and does two things on the way:

* **byte accounting** - the bytes *this rank sends* for each op, per mesh axis, using the
  bandwidth-optimal (ring / chain) algorithm's volume, the same convention as NCCL's bus
  bandwidth.  For a tensor of S bytes over n ranks a rank sends:
    all_reduce      2 (S - c_r)      (c_r = this rank's ring chunk; summed over ranks: 2 (n-1) S)
    reduce_scatter  S_in - S_out     ((n-1)/n of the input)
    all_gather      S_out - S_in     ((n-1)/n of the output)
    broadcast       S, except the last rank of the chain from the source
    reduce          S, except the destination (the chain ends there)
    all_to_all      S_in - own block ((n-1)/n of the input)
    send            S                (recv: 0)
  These are the figures the scaling formulas of the papers use, so tests compare them exactly.
* **a flight record** - each call's sequence number, op, axis, the group's global ranks, the
  call's index among this rank's calls on that axis, shape, dtype, bytes, Python call site and
  start / wait / end times, kept for the last `history` calls (0: no record), so that a hang or
  a mismatch between ranks can be explained (observe/hang.py, observe/fingerprint.py) and step
  time split into compute and communication (observe/stats.py). `listeners` are called with
  each new record (the collective-sequence fingerprint is one).

Groups of size one need no communication: such calls return at once and are not recorded.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..mesh import Mesh

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Handle:
    """A pending asynchronous operation; `wait()` blocks until it is done and stamps its record."""

    def __init__(self, work, record: CollectiveRecord | None):
        self._work = work
        self.record = record

    def wait(self) -> None:
        if self.record is not None and self.record.wait is None:
            self.record.wait = time.monotonic()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self.record is not None and self.record.end is None:
            self.record.end = time.monotonic()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


_DONE = Handle(None, None)


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


class Comm:
    """Collectives over the axes of one `Mesh`, with byte accounting and a flight record."""

    def __init__(self, mesh: Mesh, history: int = 2048):
        self.mesh = mesh
        self.traffic = Traffic()
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=history)
        self.recording = history > 0
        self.listeners: list = []  # callables taking each new CollectiveRecord
        self._seq = 0
        self._axis_seq: dict[str, int] = collections.defaultdict(int)
        self._group_ranks: dict[str, tuple] = {}

    # ------------------------------------------------------------ bookkeeping

    def _start(self, op: str, axis: str, tensor: torch.Tensor, nbytes: int) -> CollectiveRecord | None:
        self._seq += 1
        self.traffic.add(axis, op, nbytes)
        if not self.recording:
            return None
        self._axis_seq[axis] += 1
        group = self._group_ranks.get(axis)
        if group is None:
            group = self._group_ranks[axis] = tuple(self.mesh.ranks(axis))
        record = CollectiveRecord(self._seq, op, axis, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                  nbytes, _callsite(), time.monotonic(), None, group, self._axis_seq[axis])
        self.records.append(record)
        for listener in self.listeners:
            listener(record)
        return record

    def _finish(self, work, record: CollectiveRecord, async_op: bool) -> Handle | None:
        handle = Handle(work, record)
        if async_op:
            return handle
        handle.wait()
        return None

    def _trivial(self, axis: str) -> bool:
        return self.mesh.size(axis) == 1

    # ------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, axis: str, op=dist.ReduceOp.SUM, async_op: bool = False,
                   tag: str = ""):
        """In place: every rank of `axis` ends with the reduction (sum by default) of all.

        `tag` files the bytes under "all_reduce.<tag>" (e.g. "metrics" for the logged loss), so
        the gradient traffic stays comparable with its formula.
        """
        if self._trivial(axis):
            return _DONE if async_op else None
        n, r = self.mesh.size(axis), self.mesh.rank(axis)
        nbytes = 2 * (tensor.numel() - ring_chunk(tensor.numel(), n, r)) * tensor.element_size()
        record = self._start(f"all_reduce.{tag}" if tag else "all_reduce", axis, tensor, nbytes)
        work = dist.all_reduce(tensor, op=op, group=self.mesh.group(axis), async_op=async_op)
        return self._finish(work, record, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str, op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """`input` (n equal chunks along dim 0) is summed over ranks; rank i keeps chunk i in `output`."""
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (input.numel() - output.numel()) * input.element_size()
        record = self._start("reduce_scatter", axis, input, nbytes)
        work = _reduce_scatter(output, input, op=op, group=self.mesh.group(axis), async_op=async_op)
        return self._finish(work, record, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool = False,
                   tag: str = ""):
        """`output` (n chunks along dim 0) receives every rank's `input`, in coordinate order.

        `tag` files the bytes under "all_gather.<tag>" (e.g. "stats"), apart from model traffic.
        """
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (output.numel() - input.numel()) * input.element_size()
        record = self._start(f"all_gather.{tag}" if tag else "all_gather", axis, output, nbytes)
        work = _all_gather(output, input, group=self.mesh.group(axis), async_op=async_op)
        return self._finish(work, record, async_op)

    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0, async_op: bool = False):
        """From the member with coordinate `src` along `axis` to all others, in place."""
        if self._trivial(axis):
            return _DONE if async_op else None
        n, r = self.mesh.size(axis), self.mesh.rank(axis)
        last_of_chain = (src - 1) % n
        nbytes = 0 if r == last_of_chain else tensor.numel() * tensor.element_size()
        record = self._start("broadcast", axis, tensor, nbytes)
        work = dist.broadcast(tensor, src=self.mesh.global_rank_of(axis, src), group=self.mesh.group(axis),
                              async_op=async_op)
        return self._finish(work, record, async_op)

    def reduce(self, tensor: torch.Tensor, axis: str, dst: int = 0, op=dist.ReduceOp.SUM, async_op: bool = False):
        """The member with coordinate `dst` along `axis` receives the reduction, in place.

        The other members' `tensor` is scratch afterwards (its content is unspecified).
        """
        if self._trivial(axis):
            return _DONE if async_op else None
        nbytes = 0 if self.mesh.rank(axis) == dst else tensor.numel() * tensor.element_size()
        record = self._start("reduce", axis, tensor, nbytes)
        work = dist.reduce(tensor, dst=self.mesh.global_rank_of(axis, dst), op=op, group=self.mesh.group(axis),
                           async_op=async_op)
        return self._finish(work, record, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool = False):
        """Block j of `input` (n equal blocks along dim 0) goes to member j; block i of `output` comes from i."""
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (input.numel() - input.numel() // self.mesh.size(axis)) * input.element_size()
        record = self._start("all_to_all", axis, input, nbytes)
        work = dist.all_to_all_single(output, input, group=self.mesh.group(axis), async_op=async_op)
        return self._finish(work, record, async_op)

    def barrier(self, axis: str) -> None:
        if self._trivial(axis):
            return
        dist.barrier(group=self.mesh.group(axis))

    # ------------------------------------------------------------ point to point

    def send(self, tensor: torch.Tensor, axis: str, dst: int, async_op: bool = False):
        """To the member with coordinate `dst` along `axis`."""
        record = self._start("send", axis, tensor, tensor.numel() * tensor.element_size())
        peer = self.mesh.global_rank_of(axis, dst)
        if record is not None:
            record.peer = peer
        work = dist.isend(tensor, peer, group=self.mesh.group(axis))
        return self._finish(work, record, async_op)

    def recv(self, tensor: torch.Tensor, axis: str, src: int, async_op: bool = False):
        """From the member with coordinate `src` along `axis`, into `tensor`."""
        record = self._start("recv", axis, tensor, 0)
        peer = self.mesh.global_rank_of(axis, src)
        if record is not None:
            record.peer = peer
        work = dist.irecv(tensor, peer, group=self.mesh.group(axis))
        return self._finish(work, record, async_op)

    def batch_send_recv(self, sends: list[tuple[torch.Tensor, str, int]],
                        recvs: list[tuple[torch.Tensor, str, int]]) -> list[Handle]:
        """Post several sends and receives at once (one batch, so NCCL cannot deadlock on their order)."""
        ops, records = [], []
        for tensor, axis, dst in sends:
            records.append(self._start("send", axis, tensor, tensor.numel() * tensor.element_size()))
            ops.append(dist.P2POp(dist.isend, tensor, self.mesh.global_rank_of(axis, dst), self.mesh.group(axis)))
        for tensor, axis, src in recvs:
            records.append(self._start("recv", axis, tensor, 0))
            ops.append(dist.P2POp(dist.irecv, tensor, self.mesh.global_rank_of(axis, src), self.mesh.group(axis)))
        for record, op in zip(records, ops):
            if record is not None:
                record.peer = op.peer
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        return [Handle(w, rec) for w, rec in zip(works, records)]


def _callsite() -> str:
    """file:line of the first caller outside threefold's comm package (cheap frame walk)."""
    frame = sys._getframe(2)
    while frame is not None and "threefold" in frame.f_code.co_filename and "/comm/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
