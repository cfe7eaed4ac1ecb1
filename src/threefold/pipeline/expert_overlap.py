"""dualpipev's overlapped pairs as DeepSeek's DualPipe runs them: the two sides take turns.

A pair is one micro-batch's forward (F) of one chunk and another micro-batch's backward (B) of
the other chunk (schedules/registry.py `dualpipev_pairs`). The runtime (pipeline/runtime.py)
runs F on its own thread and B on a second one, but only one of them computes at a time: they
hand a turn back and forth (`Turns`). Each expert exchange of a sparse block (the row counts,
the routed rows, the experts' outputs, and in backward the gradients of both) is split into its
start and its wait (`PairedDispatch`): a side posts its exchange, asynchronously, as one
`Comm.batch_send_recv` on ep (a point-to-point all-to-all: a send to and a receive from every
other ep member), passes the turn to the other side, and waits for its exchange only when the
turn comes back. So while F's dispatch is on the wire B computes, while B's combine gradient is
on the wire F computes: attention, dispatch, experts and combine of F and B interleave, one
compute stream, as in DualPipe (DeepSeek-AI 2024, arXiv:2412.19437, section 3.2.1 and figure 4).

Order. A side changes turn only at an exchange's start, and the two sides' counts of exchanges
are the same on every member of the ep group (the same pair, the same sparse blocks), so every
member posts the exchanges in one order (F's first, B's first, F's second, ...): one ep group,
matched first in first out per pair of ranks. Every byte goes through `Comm`, filed under ep's
`send` (the bytes of the `all_to_all` they replace: the rows for other members).

Arithmetic. The exchange moves the same rows to the same places as `all_to_all_v`, the experts
see them in the same order, and only one side runs at a time on tensors of its own stage, so the
result is bit for bit the pairs run one after the other (tests/distributed/test_dualpipe_overlap.py).

Outside a pair (the warm-up and cool-down forwards and backwards, and a backward of a forward
that ran in a pair) the calling thread is no side: the exchange starts and is waited at once.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from concurrent.futures import Future

import torch
from torch import nn

from ..comm import Comm
from ..models.moe import ExpertDispatch, Experts, moe_modules

AXIS = "ep"


class Turns:
    """The sides of one pair take turns to compute on this rank (module text). `side(name)` makes the
    calling thread a side until the block ends (it waits for its first turn on entry and passes the
    turn on at exit); `switch()` hands the turn to the other side and returns when it comes back
    (True), or returns False at once: a thread that is no side, or whose other side has ended."""

    def __init__(self):
        self._cond = threading.Condition()
        self._sides: list[str] = []  # the sides still running, in turn order
        self._holder: str | None = None
        self._local = threading.local()

    def begin(self, names: list[str]) -> None:
        """A new pair of sides `names`; the first holds the turn."""
        with self._cond:
            self._sides, self._holder = list(names), names[0]

    @contextlib.contextmanager
    def side(self, name: str):
        self._local.name = name
        with self._cond:
            self._cond.wait_for(lambda: self._holder == name)
        try:
            yield
        finally:
            self._local.name = None
            with self._cond:
                self._sides.remove(name)
                self._holder = self._sides[0] if self._sides else None
                self._cond.notify_all()

    def paired(self) -> bool:
        """Whether the calling thread is a side of a pair."""
        return getattr(self._local, "name", None) is not None

    def switch(self) -> bool:
        name = getattr(self._local, "name", None)
        if name is None:
            return False
        with self._cond:
            others = [s for s in self._sides if s != name]
            if not others:
                return False
            self._holder = others[0]
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == name)
        return True


def exchange(comm: Comm, turns: Turns, x: torch.Tensor, receive: list[int], send: list[int],
             log: list | None = None) -> torch.Tensor:
    """`send[j]` rows of `x` (dim 0, in member order) to member j of ep, `receive[i]` rows from member i:
    what `Comm.all_to_all_v` returns, posted as point-to-point transfers, the turn passed between the
    start and the wait. Empty transfers are skipped on both ends (each knows the other's count).
    `log` gets (issued by a pair's side?, did the other side compute while it was in flight?, posted,
    wait began, completed), the times on the host's monotonic clock."""
    n, me = comm.mesh.size(AXIS), comm.mesh.rank(AXIS)
    x = x.contiguous()
    parts = list(x.split(send))
    arrived = [x.new_empty((receive[i], *x.shape[1:])) if i != me else parts[me] for i in range(n)]
    sends = [(parts[j], AXIS, j) for j in range(n) if j != me and send[j] > 0]
    recvs = [(arrived[i], AXIS, i) for i in range(n) if i != me and receive[i] > 0]
    handles = comm.batch_send_recv(sends, recvs)
    posted = time.monotonic()
    switched = turns.switch()
    wait = time.monotonic()
    for handle in handles:
        handle.wait()
    if log is not None:
        log.append((turns.paired(), switched, posted, wait, time.monotonic()))
    return torch.cat(arrived)


class _Rows(torch.autograd.Function):
    """Rows to their members (`exchange`); backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, dispatch, receive, send):
        ctx.dispatch, ctx.splits = dispatch, (list(receive), list(send))
        return dispatch.exchange(x, receive, send)

    @staticmethod
    def backward(ctx, grad):
        receive, send = ctx.splits
        return ctx.dispatch.exchange(grad, send, receive), None, None, None


def by_expert(by_source: torch.Tensor) -> torch.Tensor:
    """Row indices taking rows ordered (source, expert) to (expert, source), each run in its order."""
    n, local = by_source.shape
    expert = torch.arange(local, device=by_source.device).repeat(n).repeat_interleave(by_source.reshape(-1))
    return torch.argsort(expert, stable=True)


class PairedDispatch:
    """An `ExpertDispatch` (models/moe.py) over ep whose exchanges take turns (module text): the
    same routing of rows to experts as parallel/expert.py's `AllToAllDispatch`."""

    def __init__(self, comm: Comm, turns: Turns):
        self.comm, self.turns = comm, turns
        # (paired?, switched?, posted, wait, end) of each exchange not yet read
        self.log: collections.deque = collections.deque()

    def exchange(self, x: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        return exchange(self.comm, self.turns, x, receive, send, self.log)

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        n = self.comm.mesh.size(AXIS)
        local = counts.numel() // n
        by_source = self.exchange(counts.view(n, local), [1] * n, [1] * n)  # (source, my expert)
        send = counts.view(n, local).sum(1).tolist()
        receive = by_source.sum(1).tolist()
        arrived = _Rows.apply(rows, self, receive, send)
        order = by_expert(by_source)
        out = experts(arrived[order], by_source.sum(0).tolist())[torch.argsort(order)]
        return _Rows.apply(out, self, send, receive)


class DispatchSwitch:
    """Every sparse block of `module` between its own dispatch and a `PairedDispatch` (`use`)."""

    def __init__(self, module: nn.Module, comm: Comm, turns: Turns):
        self._own: list[tuple[nn.Module, ExpertDispatch]] = [(moe, moe.dispatch) for _, moe in moe_modules(module)]
        self.paired = PairedDispatch(comm, turns)

    def use(self, paired: bool) -> None:
        for moe, own in self._own:
            moe.dispatch = self.paired if paired else own


class SideThread:
    """A daemon thread running one function at a time (an overlapped pair's backward side), started
    at its first use; daemon: a failed step never keeps the process alive waiting for it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn) -> Future:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="threefold-pair", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)
