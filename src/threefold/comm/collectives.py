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
    all_to_all      S_in - own block ((n-1)/n of the input; all_to_all_v: the rows sent to others)
    send            S                (recv: 0)
  These are the figures the scaling formulas of the papers use, so tests compare them exactly.
* **a flight record** - each call's sequence number, op, axis, the group's global ranks, the
  call's index among this rank's calls on that axis, shape, dtype, bytes, Python call site and
  start / wait / end times, kept for the last `history` calls (0: no record), so that a hang or
  a mismatch between ranks can be explained (observe/hang.py, observe/fingerprint.py) and step
  time split into compute and communication (observe/stats.py). `listeners` are called with
  each new record (the collective-sequence fingerprint is one).

`end` means *completion*, not the return of `wait()`: on NCCL `wait()` only makes the current
CUDA stream wait, so a record of a CUDA tensor keeps a CUDA event recorded after that wait and
`poll()` stamps `end` once the event has passed (the hang watchdog polls; a hung collective
stays in flight and is named). On gloo (CPU) `wait()` returns on completion and stamps `end`.
Every op is issued asynchronously underneath, also the blocking ones, so this holds for all.

Semantics. `batch_send_recv` accepts both forms `dist.batch_isend_irecv` returns: one Work per
op (gloo) or one Work for the whole coalesced batch (NCCL). `Comm(..., semantics="nccl")` is a
test mode that makes gloo behave as NCCL does where it matters to the callers: one Work per
batch, `end` stamped from the Work's `is_completed()` (not when `wait()` returns), and the p2p
batches of one axis run in issue order as on NCCL's single stream (the host waits for the
previous batch of the axis before it posts the next one).

Lanes. `all_gather` and `all_gather_many` take `lane`: the call runs on the Mesh's second group over
the axis's ranks (`Mesh.add_lane`; on NCCL a communicator with a CUDA stream of its own), so it
does not queue behind the axis's other collectives. Its bytes are still the axis's (metrics by
axis do not change) and its record says the lane; `axis_seq` counts the axis's calls on all its
lanes together (every rank issues them in one order).

A thread's lane. `with comm.lane(axis, lane):` runs the all-to-alls the calling thread issues
on `axis` on that lane (a `Mesh.add_lane` group), whatever code issues them: dualpipev's pair
runs a backward on a second thread beside a forward (pipeline/runtime.py), and each thread's
all-to-alls keep to one group, so every group sees the same order on every rank. Their bytes
are the axis's; `axis_seq` counts them apart ("<axis>:<lane>"), the two threads interleaving
differently on each rank. The bookkeeping is under a lock (two threads may issue at once).

Several axes at once. `all_reduce_over`, `reduce_scatter_over` and `all_gather_over` take a
tuple of axes (`mesh.axes_where(REPLICA)`: dp and cp) and run ONE collective on the group of
all of them (`Mesh.axis_over`): filed under the one axis of size > 1 when there is one ("dp"
at cp = 1, exactly as `all_reduce(t, "dp")`), else under the joined name ("dp+cp").

Groups of size one need no communication: such calls return at once and are not recorded.
"""

from __future__ import annotations

import collections
import contextlib
import math
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..mesh import Mesh
from .records import AllOf, CollectiveRecord, Handle, Traffic, _cuda_probe, _Shared, ring_chunk

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _ThreadLanes(threading.local):
    """Each thread's {axis: lane} (`Comm.lane`)."""

    def __init__(self):
        self.lanes: dict[str, str] = {}


_DONE = Handle(None, None)
SEMANTICS = ("native", "nccl")


class Comm:
    """Collectives over the axes of one `Mesh`, with byte accounting and a flight record."""

    def __init__(self, mesh: Mesh, history: int = 2048, semantics: str = "native"):
        if semantics not in SEMANTICS:
            raise ValueError(f"unknown comm semantics '{semantics}'; choose one of {', '.join(SEMANTICS)}")
        self.mesh = mesh
        self.semantics = semantics
        # completion probe of a waited op: NCCL's wait() does not block the host, so on CUDA an
        # event after it tells completion; the nccl test mode asks the Work itself
        self._completion = ((lambda work: work.is_completed) if semantics == "nccl"
                            else _cuda_probe if mesh.device.type == "cuda" else None)
        self._last_batch: dict[str, object] = {}  # nccl test mode: axis -> Work of its last p2p batch
        self.traffic = Traffic()
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=history)
        self.recording = history > 0
        self.listeners: list = []  # callables taking each new CollectiveRecord
        self._seq = 0
        self._axis_seq: dict[str, int] = collections.defaultdict(int)
        self._group_ranks: dict[str, tuple] = {}
        self._lock = threading.Lock()  # the bookkeeping, when two threads issue (`lane`)
        self._thread = _ThreadLanes()  # {axis: lane} of the calling thread (`lane`)

    # ------------------------------------------------------------ bookkeeping

    def _start(self, op: str, axis: str, tensor: torch.Tensor, nbytes: int, lane: str = "",
               counter: str = "") -> CollectiveRecord | None:
        with self._lock:
            self._seq += 1
            self.traffic.add(axis, op, nbytes)
            if not self.recording:
                return None
            counter = counter or axis
            self._axis_seq[counter] += 1
            group = self._group_ranks.get(axis)
            if group is None:
                group = self._group_ranks[axis] = tuple(self.mesh.ranks(axis))
            record = CollectiveRecord(self._seq, op, axis, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                      nbytes, _callsite(), time.monotonic(), None, group, self._axis_seq[counter],
                                      lane=lane)
            self.records.append(record)
        for listener in self.listeners:
            listener(record)
        return record

    def _finish(self, work, record: CollectiveRecord, async_op: bool) -> Handle | None:
        handle = Handle(work, record, self._completion)
        if async_op:
            return handle
        handle.wait()
        return None

    def poll(self) -> None:
        """Stamp the completion of the records whose ops have finished since the last look."""
        for record in list(self.records):  # list(): a snapshot, safe from another thread
            if record.end is None and record.probe is not None:
                record.poll()

    def _trivial(self, axis: str) -> bool:
        return self.mesh.size(axis) == 1

    @contextlib.contextmanager
    def lane(self, axis: str, lane: str):
        """Inside, this thread's all-to-alls on `axis` run on `lane` (module text)."""
        lanes = self._thread.lanes
        before = lanes.get(axis)
        lanes[axis] = lane
        try:
            yield
        finally:
            if before is None:
                lanes.pop(axis)
            else:
                lanes[axis] = before

    def _thread_lane(self, axis: str) -> str:
        return self._thread.lanes.get(axis, "")

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
        work = dist.all_reduce(tensor, op=op, group=self.mesh.group(axis), async_op=True)
        return self._finish(work, record, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str, op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """`input` (n equal chunks along dim 0) is summed over ranks; rank i keeps chunk i in `output`."""
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (input.numel() - output.numel()) * input.element_size()
        record = self._start("reduce_scatter", axis, input, nbytes)
        work = _reduce_scatter(output, input, op=op, group=self.mesh.group(axis), async_op=True)
        return self._finish(work, record, async_op)

    # ------------------------------------------------------------ over several axes at once

    def all_reduce_over(self, tensor: torch.Tensor, axes: tuple[str, ...], op=dist.ReduceOp.SUM,
                        async_op: bool = False, tag: str = ""):
        """`all_reduce` over every axis of `axes` together: one collective on their one group."""
        return self.all_reduce(tensor, self.mesh.axis_over(axes), op=op, async_op=async_op, tag=tag)

    def reduce_scatter_over(self, output: torch.Tensor, input: torch.Tensor, axes: tuple[str, ...],
                            op=dist.ReduceOp.SUM, async_op: bool = False):
        """`reduce_scatter` over `axes` together (chunk i to coordinate i of their joined axis)."""
        return self.reduce_scatter(output, input, self.mesh.axis_over(axes), op=op, async_op=async_op)

    def all_gather_over(self, output: torch.Tensor, input: torch.Tensor, axes: tuple[str, ...],
                        async_op: bool = False, tag: str = "", lane: str = ""):
        """`all_gather` over `axes` together, in the coordinate order of their joined axis."""
        return self.all_gather(output, input, self.mesh.axis_over(axes), async_op=async_op, tag=tag, lane=lane)

    def _group(self, axis: str, lane: str):
        return self.mesh.group(axis, lane) if lane else self.mesh.group(axis)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool = False,
                   tag: str = "", lane: str = ""):
        """`output` (n chunks along dim 0) receives every rank's `input`, in coordinate order.

        `tag` files the bytes under "all_gather.<tag>" (e.g. "stats"), apart from model traffic;
        `lane` runs it on the axis's second group (module text).
        """
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (output.numel() - input.numel()) * input.element_size()
        record = self._start(f"all_gather.{tag}" if tag else "all_gather", axis, output, nbytes, lane)
        work = _all_gather(output, input, group=self._group(axis, lane), async_op=True)
        return self._finish(work, record, async_op)

    def all_gather_many(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], axis: str, lane: str = ""):
        """Several all-gathers (`all_gather` of each pair) issued as one coalesced operation
        (`torch.distributed._coalescing_manager`: one group call on NCCL; gloo runs them as one
        work); asynchronous, one handle for all, one record with their summed bytes; `lane` as
        in `all_gather`."""
        if self._trivial(axis):
            for output, input in zip(outputs, inputs):
                output.copy_(input)
            return _DONE
        nbytes = sum((o.numel() - i.numel()) * i.element_size() for o, i in zip(outputs, inputs))
        record = self._start("all_gather", axis, outputs[0], nbytes, lane)
        group = self._group(axis, lane)
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for output, input in zip(outputs, inputs):
                _all_gather(output, input, group=group, async_op=True)
        return Handle(AllOf(cm.works), record, self._completion)

    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0, async_op: bool = False):
        """From the member with coordinate `src` along `axis` to all others, in place."""
        if self._trivial(axis):
            return _DONE if async_op else None
        n, r = self.mesh.size(axis), self.mesh.rank(axis)
        last_of_chain = (src - 1) % n
        nbytes = 0 if r == last_of_chain else tensor.numel() * tensor.element_size()
        record = self._start("broadcast", axis, tensor, nbytes)
        work = dist.broadcast(tensor, src=self.mesh.global_rank_of(axis, src), group=self.mesh.group(axis),
                              async_op=True)
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
                           async_op=True)
        return self._finish(work, record, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool = False):
        """Block j of `input` (n equal blocks along dim 0) goes to member j; block i of `output` comes from i."""
        if self._trivial(axis):
            output.copy_(input)
            return _DONE if async_op else None
        nbytes = (input.numel() - input.numel() // self.mesh.size(axis)) * input.element_size()
        lane = self._thread_lane(axis)
        record = self._start("all_to_all", axis, input, nbytes, lane, f"{axis}:{lane}" if lane else "")
        work = dist.all_to_all_single(output, input, group=self._group(axis, lane), async_op=True)
        return self._finish(work, record, async_op)

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                     input_splits: list[int], axis: str, tag: str = "") -> None:
        """Rows (dim 0) of variable counts: `input_splits[j]` rows of `input` go to member j, in member
        order; `output` receives `output_splits[i]` rows from member i. Bytes sent: every row but
        those this rank keeps. `tag` files them under "all_to_all.<tag>" (e.g. the split sizes)."""
        if self._trivial(axis):
            output.copy_(input)
            return
        row = math.prod(input.shape[1:])  # elements per row (also when this rank sends no rows)
        kept = input_splits[self.mesh.rank(axis)]
        nbytes = (sum(input_splits) - kept) * row * input.element_size()
        lane = self._thread_lane(axis)
        record = self._start(f"all_to_all.{tag}" if tag else "all_to_all", axis, input, nbytes, lane,
                             f"{axis}:{lane}" if lane else "")
        work = dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                                      input_split_sizes=list(input_splits), group=self._group(axis, lane),
                                      async_op=True)
        self._finish(work, record, False)

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
        axis = (sends or recvs)[0][1]
        previous = self._last_batch.pop(axis, None)
        if previous is not None:  # nccl test mode: one stream per communicator runs batches in order
            previous.wait()
        works = dist.batch_isend_irecv(ops)
        if self.semantics == "nccl" and len(works) > 1:
            works = [AllOf(works)]
        # a Work is waited once only (gloo's send/receive works block on a second wait)
        works = [_Shared(w) for w in works]
        if self.semantics == "nccl":
            self._last_batch[axis] = works[0]
        return self._batch_handles(works, records)

    def _batch_handles(self, works: list, records: list) -> list[Handle]:
        """One handle per op, whether the backend gave one Work per op or one for the batch."""
        if len(works) == len(records):
            return [Handle(w, rec, self._completion) for w, rec in zip(works, records)]
        if len(works) == 1:  # NCCL coalesces the batch: every op completes with the one Work
            shared = works[0] if isinstance(works[0], _Shared) else _Shared(works[0])
            return [Handle(shared, rec, self._completion) for rec in records]
        raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {len(records)} ops")


def _callsite() -> str:
    """file:line of the first caller outside threefold's comm package (cheap frame walk)."""
    frame = sys._getframe(2)
    while frame is not None and "threefold" in frame.f_code.co_filename and "/comm/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
