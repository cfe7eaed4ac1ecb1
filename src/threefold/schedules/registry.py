"""Pipeline schedules as data: each rank's ordered list of actions, and their validator.

A schedule for `pp` ranks, `m` micro-batches and `v` chunks per rank has S = pp * v stages;
where stage s lives is its schedule's placement (`ScheduleKind.placement`, actions.stage_rank):
rank s % pp (chunk s // pp), the interleaved layout of Megatron-LM, or the V of zb-v and
dualpipev (rank r holds stages r and 2 pp - 1 - r). Each schedule is one `ScheduleKind` in
`SCHEDULES` (table.py, name -> registration): its order function (orders.py), checks, placement,
chunks per rank, picture hints, planner terms and, where it runs its own way, the hooks of its
runtime and step. This module is the machinery that reads the table: `build_schedule`,
`paired_schedule`, `validate`; it re-exports the table's names.
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

from collections import defaultdict

from .actions import COMM, COMPUTE, Action, Schedule, ScheduleError
from .orders import (dualpipev_order, dualpipev_pairs, gpipe_order, interleaved_order,  # noqa: F401 (their home)
                     one_f_one_b_order, pair_overlap_blockers, pipedream_2bw_order, zb_h1_order, zb_v_order)
from .posting import add_aligned_communication, add_communication
from .replay import Replay, replay
from .stream_replay import replay_stream
from .table import (DEFAULT_SCHEDULE, SCHEDULES, VIRTUAL_SCHEDULE, ScheduleKind, check, chunks_per_rank,  # noqa: F401
                    kind)

__all__ = ["Action", "ScheduleKind", "kind", "check", "chunks_per_rank", "Schedule", "ScheduleError", "Replay",
           "replay", "replay_stream", "COMM", "COMPUTE", "SCHEDULES", "DEFAULT_SCHEDULE", "VIRTUAL_SCHEDULE", "RULES",
           "build_schedule", "compute_orders", "add_communication", "validate", "paired_schedule",
           "pair_overlap_blockers"]


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
