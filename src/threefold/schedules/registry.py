"""Pipeline schedules as data: each rank's ordered list of actions, and their validator.

A schedule for `pp` ranks, `m` micro-batches and `v` chunks per rank has S = pp * v stages;
where stage s lives is its schedule's placement (`ScheduleKind.placement`, actions.stage_rank):
rank s % pp (chunk s // pp), the interleaved layout of Megatron-LM, or the V of zb-v and
dualpipev (rank r holds stages r and 2 pp - 1 - r). Each schedule is one `ScheduleKind` in
`SCHEDULES` (name -> registration): its order function, checks, placement, chunks per rank,
picture hints and planner terms.
An `Action` is (kind, stage, micro-batch):

    F        forward of one micro-batch through one stage
    B        full backward (input and weight gradients)
    I, W     the two halves of B that zero-bubble schedules separate: I computes the gradient
             of the stage input (what the previous stage waits for), W the weight gradients
             (which nobody waits for, so it can fill bubbles)
    SEND_F   stage s sends its output of the micro-batch to stage s + 1   (after F(s))
    RECV_F   stage s posts the receive of its input from stage s - 1      (before F(s))
    SEND_B   stage s sends the gradient of its input to stage s - 1       (after I/B(s))
    RECV_B   stage s posts the receive of its output gradient from s + 1  (before I/B(s))

Generators decide only the order of compute actions; `add_aligned_communication` (posting.py,
what `build_schedule` uses) or `add_communication` (the latest-receive posting) derives the
point-to-point actions from it. Sends and receive postings never block (they are async in
the runtime); a compute waits for the data it needs. Two ranks exchange messages in FIFO
order (no tags), so receives from one peer are posted in the order that peer sends them -
possibly earlier than their consumer - which makes the matching unambiguous.

`replay` (replay.py) executes the lists under exactly these rules (optionally with durations:
the simulator builds on it); `validate` proves a schedule complete, well matched and free of
deadlock. The runtime, the simulator, the pictures and the tests all read the same lists.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

from .actions import COMM, COMPUTE, Action, Schedule, ScheduleError, stage_rank
from .posting import add_aligned_communication
from .replay import Replay, replay
from .stream_replay import replay_stream
from .two_bw_timeline import check_request, shown_order

__all__ = ["Action", "ScheduleKind", "kind", "check", "chunks_per_rank", "Schedule", "ScheduleError", "Replay",
           "replay", "replay_stream", "COMM", "COMPUTE", "SCHEDULES", "RULES", "build_schedule", "compute_orders", "add_communication", "validate",
           "paired_schedule"]


# ---------------------------------------------------------------- compute orders


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


# ---------------------------------------------------------------- the registry


def pipedream_2bw_order(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-2BW (pipeline/two_bw.py): 1F1B without flush; the order of two consecutive batches (batch
    1's micro-batch i is m + i), so the picture shows the next batch's forwards entering before the
    previous batch's last backwards. The updates and the per-step segments are pipeline/two_bw.py's."""
    check_request(p, m)
    return shown_order(p, m, rank)


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
                 check=_check_2bw, shown_batches=2, synchronous=False, bubble=lambda p, m, v: 0.0),
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


def compute_orders(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's compute actions for schedule `name`; raises ValueError on a bad request.
    `v`: pipeline.virtual_stages (the V schedules take their two chunks themselves)."""
    problem = check(name, p, m, v)
    if problem:
        raise ValueError(problem)
    k = SCHEDULES[name]
    return k.orders(p, m, k.chunks_for(v))


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The complete schedule (compute and communication) of `name` for p ranks, m micro-batches.

    Every schedule uses aligned posting (posting.py): free of deadlock under NCCL's rules (the
    interleaved schedule's crossing traffic deadlocks with the latest-receive posting), and each
    receive is posted as soon as its message is under way in lock-step, not just before its
    consumer, so the transfer overlaps the compute in between instead of delaying the consumer.
    """
    orders = compute_orders(name, p, m, v)
    k = SCHEDULES[name]
    chunks = k.chunks_for(v)
    ranks = add_aligned_communication(orders, p, chunks, k.placement)
    return Schedule(name, p, m * k.shown_batches, chunks, tuple(tuple(r) for r in ranks), k.placement)


def paired_schedule(s: Schedule) -> tuple[Schedule, tuple[frozenset, ...]]:
    """`s` with each overlapped (F, B) pair of its registration (`ScheduleKind.pairs`) run as one
    unit: the pair's F and B adjacent, the communication between them moved out - all of it
    before the F when it holds no send of the F's output, all after the B when it holds no
    receive the B needs, else its receive postings before the F and its sends after. Returns the
    schedule and, per rank, the pairs that run together (pipeline/runtime.py runs the two at
    once). Run as one unit, a pair waits for both inputs and posts both outputs as this
    sequential order does, so `validate` of the result proves the overlapped execution (unit
    tests: every p <= 16, m <= 64 of the sweep, host and NCCL rules)."""
    pairs = SCHEDULES[s.name].pairs
    if pairs is None:
        return s, tuple(frozenset() for _ in range(s.pp))
    ranks, together = [], []
    for r, actions in enumerate(s.ranks):
        order, joined = list(actions), set()
        for f, b in pairs(s.pp, s.microbatches, r):
            i, k = order.index(f), order.index(b)
            between = order[i + 1:k]
            if any(a.kind not in COMM for a in between):
                continue
            if Action("SEND_F", f.stage, f.mb) not in between:  # nothing of the F's: all before it
                order[i:k + 1] = between + [f, b]
            elif Action("RECV_B", b.stage, b.mb) not in between:  # nothing the B needs: all after it
                order[i:k + 1] = [f, b] + between
            else:  # the receives before the F, the sends after the B
                receives = [a for a in between if a.kind in ("RECV_F", "RECV_B")]
                order[i:k + 1] = receives + [f, b] + [a for a in between if a not in receives]
            joined.add((f, b))
        ranks.append(tuple(order))
        together.append(frozenset(joined))
    return Schedule(s.name, s.pp, s.microbatches, s.virtual, tuple(ranks), s.placement), tuple(together)


# ---------------------------------------------------------------- communication


def _message(action: Action, num_stages: int) -> tuple | None:
    """The message a compute action sends: (tag, sending stage, mb, receiving stage)."""
    if action.kind == "F" and action.stage < num_stages - 1:
        return ("act", action.stage, action.mb, action.stage + 1)
    if action.kind in ("B", "I") and action.stage > 0:
        return ("grad", action.stage, action.mb, action.stage - 1)
    return None


def _consumed(action: Action, num_stages: int) -> tuple | None:
    """The message a compute action needs (same key as `_message` of its producer)."""
    if action.kind == "F" and action.stage > 0:
        return ("act", action.stage - 1, action.mb, action.stage)
    if action.kind in ("B", "I") and action.stage < num_stages - 1:
        return ("grad", action.stage + 1, action.mb, action.stage)
    return None


def _send_action(msg) -> Action:
    tag, src_stage, mb, _ = msg
    return Action("SEND_F" if tag == "act" else "SEND_B", src_stage, mb)


def _recv_action(msg) -> Action:
    tag, _, mb, dst_stage = msg
    return Action("RECV_F" if tag == "act" else "RECV_B", dst_stage, mb)


def add_communication(orders: list[list[Action]], p: int, v: int,
                      placement: str = "interleaved") -> list[list[Action]]:
    """Insert the sends (right after their producer) and receive postings (FIFO per peer)."""
    num_stages = p * v
    rank_of = lambda s: stage_rank(placement, p, s)  # noqa: E731
    sent: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> messages in send order
    for r, order in enumerate(orders):
        for a in order:
            msg = _message(a, num_stages)
            if msg is not None and rank_of(msg[3]) != r:
                sent[(r, rank_of(msg[3]))].append(msg)
    out = []
    for dst, order in enumerate(orders):
        consumer_at = {}
        for index, a in enumerate(order):
            msg = _consumed(a, num_stages)
            if msg is not None:
                consumer_at[msg] = index
        recvs_before: dict[int, list] = defaultdict(list)
        for (src, d), messages in sorted(sent.items()):
            if d != dst:
                continue
            # post receive k no later than the first consumer of messages k, k+1, ... (FIFO)
            latest = len(order)
            positions = []
            for msg in reversed(messages):
                latest = min(latest, consumer_at.get(msg, len(order)))
                positions.append(latest)
            for msg, pos in zip(messages, reversed(positions)):
                recvs_before[pos].append(msg)
        actions = []
        for index, a in enumerate(order + [None]):
            actions += [_recv_action(msg) for msg in recvs_before.get(index, ())]
            if a is None:
                break
            actions.append(a)
            msg = _message(a, num_stages)
            if msg is not None and rank_of(msg[3]) != dst:
                actions.append(_send_action(msg))
        out.append(actions)
    return out


# ---------------------------------------------------------------- validation


RULES = ("host", "nccl")


def validate(s: Schedule, rules: tuple[str, ...] = RULES) -> None:
    """Prove `s` complete, well matched and deadlock-free; raise ScheduleError otherwise.

    Checks: every action sits on the rank of its stage; every (stage, micro-batch) has exactly
    one F and either one B or one I followed by one W; every message between ranks has exactly
    one send (after its producer) and one receive (before its consumer), and each pair of ranks
    posts receives in the order the peer sends (FIFO matching); execution finishes on every rank
    under each of `rules`: "host" - sends and receive postings never block (gloo; replay.py) -
    and "nccl" - each run of communication actions is one batch, a rank's batches run in order
    on one stream, a send blocks until its receive is posted (stream_replay.py).
    """
    S, m = s.num_stages, s.microbatches
    if len(s.ranks) != s.pp:
        raise ScheduleError(f"{len(s.ranks)} action lists for pp={s.pp}")
    counts: dict[Action, int] = defaultdict(int)
    position: dict[Action, int] = {}
    for r, actions in enumerate(s.ranks):
        for index, a in enumerate(actions):
            if a.kind not in COMPUTE + COMM:
                raise ScheduleError(f"rank {r}: unknown action kind in {a}")
            if not (0 <= a.stage < S and 0 <= a.mb < m):
                raise ScheduleError(f"rank {r}: {a} is outside stages 0..{S - 1} / micro-batches 0..{m - 1}")
            if s.stage_rank(a.stage) != r:
                raise ScheduleError(f"rank {r}: {a} belongs to rank {s.stage_rank(a.stage)}")
            if a.kind in COMM and not _is_edge(s, a):
                raise ScheduleError(f"rank {r}: {a} does not cross to another rank")
            counts[a] += 1
            position[a] = index
    for a, n in counts.items():
        if n > 1:
            raise ScheduleError(f"{a} appears {n} times on rank {s.stage_rank(a.stage)}")
    for stage in range(S):
        r = s.stage_rank(stage)
        for mb in range(m):
            f, b, i, w = (Action(k, stage, mb) for k in COMPUTE)
            if f not in counts:
                raise ScheduleError(f"rank {r} never runs {f}")
            if b in counts and (i in counts or w in counts):
                raise ScheduleError(f"rank {r} runs both {b} and the split {i}/{w}")
            if b not in counts and not (i in counts and w in counts):
                raise ScheduleError(f"rank {r} never completes the backward of micro-batch {mb} on stage {stage}")
            if i in counts and position[w] < position[i]:
                raise ScheduleError(f"rank {r} runs {w} before {i}")
            _check_messages(s, stage, mb, counts, position)
    sent, received = defaultdict(list), defaultdict(list)
    for r, actions in enumerate(s.ranks):
        for a in actions:
            if a.kind in ("SEND_F", "SEND_B"):
                dst = s.stage_rank(a.stage + (1 if a.kind == "SEND_F" else -1))
                sent[(r, dst)].append(("act" if a.kind == "SEND_F" else "grad", a.stage, a.mb))
            elif a.kind in ("RECV_F", "RECV_B"):
                src_stage = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
                received[(s.stage_rank(src_stage), r)].append(
                    ("act" if a.kind == "RECV_F" else "grad", src_stage, a.mb))
    for channel in set(sent) | set(received):
        if sent[channel] != received[channel]:
            first = next((k for k, (x, y) in enumerate(zip(sent[channel], received[channel])) if x != y),
                         min(len(sent[channel]), len(received[channel])))
            raise ScheduleError(f"rank {channel[1]} posts receives from rank {channel[0]} in another order than "
                                f"it sends (message #{first}): FIFO matching would swap tensors")
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown rules {sorted(unknown)}; choose from {', '.join(RULES)}")
    if "host" in rules:
        replay(s)
    if "nccl" in rules:
        replay_stream(s)


def _is_edge(s: Schedule, a: Action) -> bool:
    """Whether comm action `a` names a message between stages on different ranks."""
    peer = a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)
    return 0 <= peer < s.num_stages and s.stage_rank(peer) != s.stage_rank(a.stage)


def _check_messages(s: Schedule, stage: int, mb: int, counts: dict, position: dict) -> None:
    """The cross-rank edges of (stage, mb) each have one send after the producer, one receive before the consumer."""
    S = s.num_stages
    edges = []
    if stage < S - 1:
        edges.append((Action("F", stage, mb), Action("SEND_F", stage, mb),
                      Action("RECV_F", stage + 1, mb), Action("F", stage + 1, mb)))
    if stage > 0:
        producer = Action("B", stage, mb) if Action("B", stage, mb) in counts else Action("I", stage, mb)
        consumer = (Action("B", stage - 1, mb) if Action("B", stage - 1, mb) in counts
                    else Action("I", stage - 1, mb))
        edges.append((producer, Action("SEND_B", stage, mb), Action("RECV_B", stage - 1, mb), consumer))
    for producer, send, recv, consumer in edges:
        local = s.stage_rank(producer.stage) == s.stage_rank(consumer.stage)
        if local:
            if send in counts or recv in counts:
                raise ScheduleError(f"{send}/{recv} between stages on the same rank")
            continue
        for comm in (send, recv):
            if comm not in counts:
                raise ScheduleError(f"rank {s.stage_rank(comm.stage)} lacks {comm}")
        if position[send] < position[producer]:
            raise ScheduleError(f"rank {s.stage_rank(send.stage)} runs {send} before {producer}")
        if position[recv] > position[consumer]:
            raise ScheduleError(f"rank {s.stage_rank(recv.stage)} posts {recv} after {consumer} needs it")
