"""Pipeline schedules as data: each rank's ordered list of actions, and their validator.

A schedule for `pp` ranks, `m` micro-batches and `v` virtual stages per rank has S = pp * v
stages; stage s lives on rank s % pp (chunk s // pp), the interleaved layout of Megatron-LM.
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

from .actions import COMM, COMPUTE, Action, Schedule, ScheduleError
from .posting import add_aligned_communication
from .replay import Replay, replay
from .stream_replay import replay_stream

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream-2bw")
__all__ = ["Action", "Schedule", "ScheduleError", "Replay", "replay", "replay_stream", "COMM", "COMPUTE", "SCHEDULES",
           "RULES", "build_schedule", "compute_orders", "add_communication", "validate"]


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


def pipedream_2bw_order(p: int, m: int, rank: int) -> list[Action]:
    """PipeDream-2BW (two_bw.py): 1F1B without flush; the order of two consecutive batches (batch
    1's micro-batch i is m + i), so the picture shows the next batch's forwards entering before the
    previous batch's last backwards. The updates and the per-step segments are two_bw.py's."""
    from .two_bw import check_request, shown_order

    check_request(p, m)
    return shown_order(p, m, rank)


def compute_orders(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's compute actions for schedule `name`; raises ValueError on a bad request."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule '{name}'; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp, microbatches and virtual stages must be at least 1 (got {p}, {m}, {v})")
    if name != "interleaved" and v != 1:
        raise ValueError(f"schedule '{name}' runs one stage per rank; virtual stages need 'interleaved'")
    if name == "interleaved":
        if m < p:
            raise ValueError(f"interleaved needs at least as many micro-batches as pipeline ranks "
                             f"({m} < {p}); raise microbatches to {p} or more")
        return [interleaved_order(p, m, r, v) for r in range(p)]
    order_fn = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb-h1": zb_h1_order,
                "pipedream-2bw": pipedream_2bw_order}[name]
    return [order_fn(p, m, r) for r in range(p)]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The complete schedule (compute and communication) of `name` for p ranks, m micro-batches.

    Every schedule uses aligned posting (posting.py): free of deadlock under NCCL's rules (the
    interleaved schedule's crossing traffic deadlocks with the latest-receive posting), and each
    receive is posted as soon as its message is under way in lock-step, not just before its
    consumer, so the transfer overlaps the compute in between instead of delaying the consumer.
    """
    orders = compute_orders(name, p, m, v)
    shown = 2 * m if name == "pipedream-2bw" else m  # two batches without flush (two_bw.py)
    return Schedule(name, p, shown, v, tuple(tuple(r) for r in add_aligned_communication(orders, p, v)))


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


def add_communication(orders: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Insert the sends (right after their producer) and receive postings (FIFO per peer)."""
    num_stages = p * v
    rank_of = lambda s: s % p  # noqa: E731
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
