"""Where the point-to-point actions go: aligned posting, placed so that NCCL's rules cannot deadlock it.

`add_communication` (the latest-receive posting) sends right after the producer and posts each
receive as late as FIFO matching allows. Under NCCL's rules (one in-order stream per communicator, sends that
block until the receive is posted; stream_replay.py) an early receive can hold up the sends
queued behind it, and the interleaved schedule's crossing traffic between neighbours then
deadlocks. `add_aligned_communication` derives the postings from a lock-step execution of the
compute orders instead: in round t every rank first runs communication batch t, then at most
one compute action, the next in its order, if its input is there. A message produced in round
t travels in batch t + 1 on both of its ranks: the sender's send right after its producer, the
receiver's receive in the same batch index. Each rank's batches are thus matched one to one by
its neighbours' batches of the same index, so batch t completes on every rank once every rank
has posted it, which every host does after round t - 1: no cycle can form. Within a batch the
operations of one channel are ordered by (kind, stage, micro-batch) on both sides (FIFO).
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Action, ScheduleError, stage_rank


def _sent(a: Action, num_stages: int) -> tuple | None:
    """(tag, sending stage, mb, receiving stage) of the message compute action `a` produces."""
    if a.kind == "F" and a.stage < num_stages - 1:
        return ("act", a.stage, a.mb, a.stage + 1)
    if a.kind in ("B", "I") and a.stage > 0:
        return ("grad", a.stage, a.mb, a.stage - 1)
    return None


def _needed(a: Action, num_stages: int) -> tuple | None:
    """The message compute action `a` needs (the key `_sent` gives its producer's)."""
    if a.kind == "F" and a.stage > 0:
        return ("act", a.stage - 1, a.mb, a.stage)
    if a.kind in ("B", "I") and a.stage < num_stages - 1:
        return ("grad", a.stage + 1, a.mb, a.stage)
    return None


def _send(msg) -> Action:
    return Action("SEND_F" if msg[0] == "act" else "SEND_B", msg[1], msg[2])


def _recv(msg) -> Action:
    return Action("RECV_F" if msg[0] == "act" else "RECV_B", msg[3], msg[2])


def add_aligned_communication(orders: list[list[Action]], p: int, v: int,
                              placement: str = "interleaved") -> list[list[Action]]:
    """The compute orders with sends and receives in lock-step-aligned batches (module docstring).
    Messages between two stages on one rank (the V placement's stages p - 1 and p) are local
    hand-offs: no transfer."""
    num_stages = p * v
    rank_of = lambda s: stage_rank(placement, p, s)  # noqa: E731
    pc = [0] * p
    arrived: set = set()  # remote messages whose batch has run
    in_transit: list = []  # remote messages produced in the previous round
    out: list[list[Action]] = [[] for _ in range(p)]
    total = sum(len(o) for o in orders)
    done = 0
    while done < total:
        batch: dict[int, list] = defaultdict(list)
        for msg in sorted(in_transit):  # batch t: the previous round's messages, on both ends
            batch[rank_of(msg[1])].append((msg, 0))
            batch[rank_of(msg[3])].append((msg, 1))
            arrived.add(msg)
        for r, ops in batch.items():
            out[r] += [_send(msg) if side == 0 else _recv(msg) for msg, side in sorted(ops)]
        in_transit = []
        progressed = False
        for r in range(p):  # then one compute action per rank, when its input is here
            if pc[r] == len(orders[r]):
                continue
            a = orders[r][pc[r]]
            need = _needed(a, num_stages)
            if need is not None and rank_of(need[1]) != r and need not in arrived:
                continue
            out[r].append(a)
            pc[r] += 1
            done += 1
            progressed = True
            msg = _sent(a, num_stages)
            if msg is not None and rank_of(msg[3]) != r:
                in_transit.append(msg)
        if not progressed and not batch:
            stuck = "; ".join(f"rank {r} at {orders[r][pc[r]]}" for r in range(p) if pc[r] < len(orders[r]))
            raise ScheduleError(f"the compute orders deadlock: {stuck}")
    for msg in sorted(in_transit):  # the last round's messages (none: the last actions send nothing)
        out[rank_of(msg[1])].append(_send(msg))
        out[rank_of(msg[3])].append(_recv(msg))
    return out


def add_communication(orders: list[list[Action]], p: int, v: int,
                      placement: str = "interleaved") -> list[list[Action]]:
    """Insert the sends (right after their producer) and receive postings (FIFO per peer)."""
    num_stages = p * v
    rank_of = lambda s: stage_rank(placement, p, s)  # noqa: E731
    sent: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> messages in send order
    for r, order in enumerate(orders):
        for a in order:
            msg = _sent(a, num_stages)
            if msg is not None and rank_of(msg[3]) != r:
                sent[(r, rank_of(msg[3]))].append(msg)
    out = []
    for dst, order in enumerate(orders):
        consumer_at = {}
        for index, a in enumerate(order):
            msg = _needed(a, num_stages)
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
            actions += [_recv(msg) for msg in recvs_before.get(index, ())]
            if a is None:
                break
            actions.append(a)
            msg = _sent(a, num_stages)
            if msg is not None and rank_of(msg[3]) != dst:
                actions.append(_send(msg))
        out.append(actions)
    return out
