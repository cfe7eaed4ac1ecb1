"""Each schedule's compute order: which F, B, I and W actions a rank runs, in what order (no
communication: posting.py adds it). Pure Python; the table of schedules (table.py) names them."""

from __future__ import annotations

from collections import deque

from .actions import Action
from .two_bw_timeline import check_request, shown_order


def gpipe_order(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (GPipe): every micro-batch's activations are held at once."""
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-flush): p-1-rank warm-up forwards, then alternate, then drain backwards."""
    warmup = min(p - 1 - rank, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [Action("F", rank, i), Action("B", rank, i - warmup)]
    order += [Action("B", rank, i) for i in range(m - warmup, m)]
    return order


def interleaved_order(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): v model chunks per rank, micro-batches in groups.

    Forwards visit chunk 0 for a group of micro-batches, then chunk 1 for the same group, ...;
    backwards visit the chunks in reverse. Groups hold p micro-batches when p divides m;
    otherwise the m // p groups share the remainder, larger ones first, so that no group is
    smaller than p (a short group would make the last rank need a gradient before it has run
    the forward that leads to it: a deadlock). The warm-up is 2 (p-1-rank) + (v-1) * group.
    """
    count = max(1, m // p)
    base, extra = divmod(m, count)
    sizes = [base + 1] * extra + [base] * (count - extra)
    forwards, backwards, first = [], [], 0
    for size in sizes:
        group = range(first, first + size)
        first += size
        forwards += [Action("F", c * p + rank, i) for c in range(v) for i in group]
        backwards += [Action("B", c * p + rank, i) for c in reversed(range(v)) for i in group]
    total = m * v
    warmup = min(2 * (p - 1 - rank) + (v - 1) * sizes[0], total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def zb_h1_order(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I and W; W deferred.

    Rank r runs 1F1B with I in place of B; in the steady phase the W of the oldest pending
    micro-batch follows each I, except for the first r iterations (later stages postpone their
    first W's so their I's reach upstream ranks sooner); the cool-down fills the gaps between
    I's with the deferred W's. In-flight micro-batches (from F to W) stay at most p.
    """
    warmup = min(p - 1 - rank, m)
    order = [Action("F", rank, i) for i in range(warmup)]
    pending: deque[int] = deque()
    for k, i in enumerate(range(warmup, m)):
        order += [Action("F", rank, i), Action("I", rank, i - warmup)]
        pending.append(i - warmup)
        if k >= rank:
            order.append(Action("W", rank, pending.popleft()))
    for i in range(m - warmup, m):
        order.append(Action("I", rank, i))
        pending.append(i)
        order.append(Action("W", rank, pending.popleft()))
    order += [Action("W", rank, i) for i in pending]
    return order


def zb_v_order(p: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, *Pipeline Parallelism with Controllable Memory*; torch's ZBVZeroBubble).

    Two chunks per rank in a V: chunk 0 is stage `rank`, chunk 1 stage 2p - 1 - rank. Warm-up:
    2(p - rank) - 1 forwards of chunk 0, then `rank` pairs (F chunk 1, F chunk 0), then p - rank
    rounds (F, I, W) of chunk 1. Steady: (F, I, W) of chunk 0 then of chunk 1 (a forward of
    chunk 0 only while micro-batches remain). Cool-down: `rank` pairs (I chunk 0, I chunk 1),
    p - rank pairs (I, W) of chunk 0, then the deferred W's of chunk 1 and of chunk 0. The order
    is laid out for max(m, 2p - 1) micro-batches and the actions of micro-batches >= m dropped.
    """
    n = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    order: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    order += [Action("F", c0, i) for i in range(2 * (p - rank) - 1)]
    f0 = 2 * (p - rank) - 1
    for _ in range(rank):
        order += [Action("F", c1, f1), Action("F", c0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        order += [Action("F", c1, f1), Action("I", c1, b1), Action("W", c1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append(Action("F", c0, f0))
            f0 += 1
        order += [Action("I", c0, b0), Action("W", c0, b0), Action("F", c1, f1), Action("I", c1, b1),
                  Action("W", c1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [Action("I", c0, b0), Action("I", c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        order += [Action("I", c0, b0), Action("W", c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [Action("W", c1, i) for i in range(w1, b1)]
    order += [Action("W", c0, i) for i in range(w0, b0)]
    return [a for a in order if a.mb < m]


def dualpipev_order(p: int, m: int, rank: int) -> list[Action]:
    return _dualpipev(p, m, rank)[0]


def pair_overlap_blockers(tp: int, zero: int, remat: str, compiled: bool) -> list[str]:
    """What keeps a paired schedule's (F, B) pairs from running at once, each side's expert all-to-alls
    on its own ep group (pipeline/runtime.py): any other collective inside a stage, or process-wide
    state two threads would share. Empty: the pairs overlap (with ep > 1)."""
    return [why for blocked, why in ((tp > 1, f"parallel.tp={tp}"), (zero >= 3, f"parallel.zero={zero}"),
                                     (remat != "none", f"remat.policy={remat}"), (compiled, "train.compile=true"))
            if blocked]


def dualpipev_pairs(p: int, m: int, rank: int) -> list[tuple[Action, Action]]:
    """The (forward, backward) pairs DualPipeV overlaps on `rank`, each adjacent in its order."""
    return _dualpipev(p, m, rank)[1]


def _dualpipev(p: int, m: int, rank: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """DualPipeV (DeepSeek's DualPipe folded into a V; torch's ScheduleDualPipeV), m >= 2p.

    Chunk 0 is stage `rank`, chunk 1 stage 2p - 1 - rank. Steps: 2(p - 1 - rank) forwards of
    chunk 0; rank + 1 pairs (F chunk 0, F chunk 1); p - 1 - rank rounds (I chunk 1, oldest
    pending W, F chunk 1); the main phase of m - 2p + rank + 1 rounds of two overlapped pairs,
    (F chunk 0 + B chunk 1) and (F chunk 1 + B chunk 0) (the last rank's first round runs its
    first pair as plain F, B); p - 1 - rank rounds (B chunk 1, pair F chunk 1 + B chunk 0);
    rank + 1 rounds (backward chunk 1, backward chunk 0) that switch from B to I halfway (the
    W's deferred); p - 1 - rank rounds (pending W, backward chunk 0); then the pending W's.
    An overlapped pair is its forward followed by its backward in the list (`dualpipev_pairs`).
    """
    c0, c1 = rank, 2 * p - 1 - rank
    fwd = {c0: 0, c1: 0}
    bwd = {c0: 0, c1: 0}
    pending: deque[Action] = deque()
    order: list[Action] = []
    pairs: list[tuple[Action, Action]] = []

    def forward(stage):
        order.append(Action("F", stage, fwd[stage]))
        fwd[stage] += 1

    def backward(stage, split=False):
        order.append(Action("I" if split else "B", stage, bwd[stage]))
        if split:
            pending.append(Action("W", stage, bwd[stage]))
        bwd[stage] += 1

    def weight():
        if pending:
            order.append(pending.popleft())

    def pair(f_stage, b_stage, overlapped=True):
        forward(f_stage)
        backward(b_stage)
        if overlapped:
            pairs.append((order[-2], order[-1]))

    for _ in range(2 * (p - 1 - rank)):
        forward(c0)
    for _ in range(rank + 1):
        forward(c0)
        forward(c1)
    for _ in range(p - 1 - rank):
        backward(c1, split=True)
        weight()
        forward(c1)
    for i in range(m - 2 * p + rank + 1):
        pair(c0, c1, overlapped=not (i == 0 and rank == p - 1))  # the last rank's first: plain F, B
        pair(c1, c0)
    for _ in range(p - 1 - rank):
        backward(c1)
        pair(c1, c0)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(c1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(c0, split)
    for _ in range(p - 1 - rank):
        weight()
        backward(c0, split)
    for _ in range(rank + 1):
        weight()
    while pending:
        weight()
    return order, pairs



def pipedream_2bw_order(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-2BW (pipeline/two_bw.py): 1F1B without flush; the order of two consecutive batches (batch
    1's micro-batch i is m + i), so the picture shows the next batch's forwards entering before the
    previous batch's last backwards. The updates and the per-step segments are pipeline/two_bw.py's."""
    check_request(p, m)
    return shown_order(p, m, rank)
