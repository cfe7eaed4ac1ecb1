"""The validator's second mode: NCCL's execution rules for point-to-point batches.

On NCCL the runtime's communication behaves differently from the host-side rules of
`replay` (replay.py), and a schedule that terminates under those can deadlock here:

* each run of consecutive SEND/RECV actions is posted as one batch (`batch_isend_irecv`), and
  NCCL runs the batches of one communicator **in issue order on one stream**: batch k + 1 of a
  rank starts only when batch k has completed;
* a (large) **send blocks until the matching receive is posted**, and a receive until the
  matching send is: an operation completes once both its side's batch and the peer's batch
  holding the matching operation are running; a batch completes when all its operations have;
* posting never blocks the host, which runs its actions in order; a compute action waits for
  the batch holding the receive of its input (the Work of a coalesced batch is one).

`replay_stream` applies these rules until nothing moves; any action or batch left over is a
deadlock, named in the ScheduleError. It needs no durations: it decides termination only.
"""

from __future__ import annotations

from collections import deque

from .actions import COMM, Action, Schedule, ScheduleError


def _batches(actions: tuple[Action, ...]) -> tuple[list[int], list[list[Action]]]:
    """Index of the batch each action belongs to (-1 for compute) and the batches in order."""
    where, batches = [], []
    previous_comm = False
    for a in actions:
        if a.kind in COMM:
            if not previous_comm:
                batches.append([])
            batches[-1].append(a)
            where.append(len(batches) - 1)
            previous_comm = True
        else:
            where.append(-1)
            previous_comm = False
    return where, batches


def _message(a: Action, s: Schedule) -> tuple:
    """The message a comm action sends or receives: (tag, sending stage, mb)."""
    if a.kind == "SEND_F":
        return ("act", a.stage, a.mb)
    if a.kind == "SEND_B":
        return ("grad", a.stage, a.mb)
    if a.kind == "RECV_F":
        return ("act", a.stage - 1, a.mb)
    return ("grad", a.stage + 1, a.mb)


def _input_message(a: Action, rank: int, s: Schedule) -> tuple | None:
    """The message compute action `a` waits for, when it comes from another rank."""
    if a.kind == "F" and a.stage > 0 and s.stage_rank(a.stage - 1) != rank:
        return ("act", a.stage - 1, a.mb)
    if a.kind in ("B", "I") and a.stage < s.num_stages - 1 and s.stage_rank(a.stage + 1) != rank:
        return ("grad", a.stage + 1, a.mb)
    return None


def replay_stream(s: Schedule) -> None:
    """Execute `s` under NCCL's rules (module docstring); raise ScheduleError on a deadlock."""
    p = s.pp
    where, batches = zip(*(_batches(actions) for actions in s.ranks))
    # message -> (rank, batch) of its send and of its receive
    send_at, recv_at = {}, {}
    for r in range(p):
        for b, batch in enumerate(batches[r]):
            for a in batch:
                (send_at if a.kind.startswith("SEND") else recv_at)[_message(a, s)] = (r, b)
    # the peer's (rank, batch) each operation of each batch needs running
    partners = [[[(recv_at if a.kind.startswith("SEND") else send_at).get(_message(a, s)) for a in batch]
                 for batch in batches[r]] for r in range(p)]
    for r in range(p):
        for b, batch in enumerate(batches[r]):
            for a, partner in zip(batch, partners[r][b]):
                if partner is None:
                    raise ScheduleError(f"rank {r}: {a} has no matching operation on the peer")
    pc = [0] * p  # host: next action
    posted = [0] * p  # batches posted so far
    done = [0] * p  # batches completed (the stream runs batch `done` next)

    def running(rank: int, batch: int) -> bool:
        return batch < done[rank] or (batch == done[rank] and batch < posted[rank])

    def advance(r: int) -> bool:
        moved = False
        actions = s.ranks[r]
        while pc[r] < len(actions):  # the host
            a = actions[pc[r]]
            if a.kind in COMM:
                posted[r] = max(posted[r], where[r][pc[r]] + 1)
            else:
                msg = _input_message(a, r, s)
                if msg is not None and recv_at[msg][1] >= done[r]:
                    break
            pc[r] += 1
            moved = True
        while done[r] < posted[r] and all(running(q, b) for q, b in partners[r][done[r]]):  # the stream
            done[r] += 1
            moved = True
        return moved

    todo, queued = deque(range(p)), set(range(p))
    while todo:
        r = todo.popleft()
        queued.discard(r)
        if advance(r):
            for q in {r, (r - 1) % p, (r + 1) % p}:
                if q not in queued:
                    todo.append(q)
                    queued.add(q)
    stuck = []
    for r in range(p):
        if pc[r] < len(s.ranks[r]):
            stuck.append(f"rank {r} waits at {s.ranks[r][pc[r]]}")
        elif done[r] < len(batches[r]):
            stuck.append(f"rank {r}'s stream waits in the batch [{', '.join(map(str, batches[r][done[r]]))}]")
    if stuck:
        raise ScheduleError(f"{s.name} (pp={s.pp}, m={s.microbatches}, v={s.virtual}) deadlocks under NCCL's "
                            "rules (in-order stream, blocking sends): " + "; ".join(stuck))
