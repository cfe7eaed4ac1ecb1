"""The runtime executes schedules as the schedule says: the order of actions, the messages, the
activations held, and the bubble that order gives.

Stages whose every action sleeps a short fixed time and passes zeros on run the schedules through
the real runtime (gloo point-to-point messages between 4 processes). What is asserted does not
depend on how long anything took: each rank's order of compute actions (exact), causality (no
action starts before the action producing its input ended), the point-to-point messages each
rank posts (counts: no collective or synchronisation the schedule lacks), the activations held
per rank, and the bubble the *recorded order* gives when re-timed with unit costs by a plain
dependency walk written here (F = I = W = 1, B = 2), against the simulator's and the textbook
formulas. How the measured wall-clock bubble compares with the simulated one is a benchmark
(bench/pipeline_bubble.py), not a pass/fail bound: on 2 shared cores it moves with the load.
"""

from collections import Counter

import torch

from threefold.comm import Comm
from threefold.data import Batch
from threefold.mesh import Layout, Mesh
from threefold.pipeline.runtime import PipelineRuntime
from threefold.schedules.registry import build_schedule
from threefold.pipeline.simulate import Costs, simulate
from threefold.pipeline.stage import Stage
from threefold.pipeline.timeline import peak_in_flight

UNIT_S = 0.002  # one forward: long enough that a rank's actions never share a start time
SHAPE = (2, 4, 8)  # what crosses stages
P = 4
UNITS = {"F": 1, "B": 2, "I": 1, "W": 1}


class SleepCompute:
    """A stage whose every action takes a known time."""

    meter = None
    side_loss = 0.0

    def __init__(self, unit_s: float):
        self.unit = unit_s

    def begin(self, global_tokens):
        pass

    def _work(self, units: float):
        import time

        time.sleep(self.unit * units)

    def forward(self, stage, x, targets):
        self._work(1)
        return (torch.zeros(()) if stage.last else torch.zeros(SHAPE)), None

    def backward(self, stage, state, grad):
        self._work(2)
        return None if stage.first else torch.zeros(SHAPE)

    def backward_input(self, stage, state, grad):
        self._work(1)
        return None if stage.first else torch.zeros(SHAPE)

    def backward_weight(self, stage, state):
        self._work(1)


def run_schedules(runs: list[tuple[str, int, int]], unit_s: float) -> list[tuple[list, Counter]]:
    """On every rank: each (schedule, m, v) once; its timeline and the ops Comm recorded meanwhile."""
    mesh = Mesh(Layout(pp=P), torch.device("cpu"))
    comm = Comm(mesh)
    rank = mesh.rank("pp")
    out = []
    for name, m, v in runs:
        schedule = build_schedule(name, P, m, v)
        stages = [Stage(s, range(0), s == 0, s == schedule.num_stages - 1) for s in schedule.stages_of(rank)]
        runtime = PipelineRuntime(schedule, stages, SleepCompute(unit_s), comm, lambda shape: SHAPE)
        batches = [Batch(torch.zeros(SHAPE[:2], dtype=torch.long), torch.zeros(SHAPE[:2], dtype=torch.long))] * m
        comm.barrier("pp")
        seen = comm.records[-1].seq if comm.records else 0
        runtime.forward_backward(batches, 1)
        out.append((runtime.timeline, Counter(r.op for r in comm.records if r.seq > seen)))
    return out


def producer(kind: str, stage: int, mb: int, last_stage: int) -> tuple | None:
    """The action whose result (kind, stage, mb) waits for, or None (its input is local)."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind == "W":
        return ("I", stage, mb)
    return ("F", stage, mb) if stage == last_stage else ("B", stage + 1, mb)


def retimed_bubble(order: list[list[tuple]], last_stage: int) -> list[float]:
    """Per rank, the idle share of the makespan when each rank runs its actions in `order` (per rank,
    (kind, stage, mb)) with unit costs, each starting once its rank is free and its input exists
    (the input of a backward is the next stage's B, or its I when the backward is split)."""
    end, pc, clock = {}, [0] * len(order), [0.0] * len(order)
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(order):
            while pc[r] < len(actions):
                kind, stage, mb = actions[pc[r]]
                need = producer(kind, stage, mb, last_stage)
                if need is not None and need not in end and need[0] == "B":
                    need = ("I", *need[1:])
                if need is not None and need not in end:
                    break
                start = max(clock[r], end[need] if need is not None else 0.0)
                clock[r] = end[(kind, stage, mb)] = start + UNITS[kind]
                pc[r] += 1
                progress = True
    assert all(p == len(a) for p, a in zip(pc, order)), "the recorded order deadlocks"
    return [1 - sum(UNITS[k] for k, _, _ in actions) / max(clock) for actions in order]


def check_run(name: str, m: int, v: int, timeline: list, ops: list[Counter]) -> list[float]:
    """Order, causality, messages and activations of one run; the bubble its recorded order gives."""
    schedule = build_schedule(name, P, m, v)
    events = [e for e in timeline if e.kind in UNITS]
    by_action = {(e.kind, e.stage, e.mb): e for e in events}
    last_stage = schedule.num_stages - 1
    order = []
    for rank, actions in enumerate(schedule.ranks):
        mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start)
        ran = [(e.kind, e.stage, e.mb) for e in mine]
        assert ran == [(a.kind, a.stage, a.mb) for a in actions if a.kind in UNITS], f"{name} rank {rank}"
        order.append(ran)
        for e in mine:
            need = producer(e.kind, e.stage, e.mb, last_stage)
            if need is not None:
                done = by_action.get(need) or by_action[("I", *need[1:])]
                assert done.end <= e.start, f"{name}: {e} started before its input {done} was done"
        sends = sum(a.kind.startswith("SEND") for a in actions)
        recvs = sum(a.kind.startswith("RECV") for a in actions)
        assert ops[rank] == Counter({"send": sends, "recv": recvs}) - Counter(), f"{name} rank {rank}: {ops[rank]}"
    nominal = simulate(schedule, Costs(1, 1, 1))
    assert peak_in_flight(events, P) == nominal.peak_activations, name
    bubble = retimed_bubble(order, last_stage)
    assert max(abs(a - b) for a, b in zip(bubble, nominal.bubble)) < 1e-12, (name, bubble, nominal.bubble)
    return bubble


RUNS = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 8, 1),
        ("zb-v", 8, 1), ("dualpipev", 8, 1), ("1f1b", 8, 1)]
# the textbook bubble with F = I = W = 1: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved;
# the zero-bubble schedules idle (p-1)(F+I-W) = p-1 units of 3m (ZB-H1) or 6m (two chunks: ZB-V, DualPipeV)
TEXTBOOK = {("gpipe", 4): 3 / 7, ("1f1b", 4): 3 / 7, ("interleaved", 4): 3 / 11, ("zb-h1", 8): 3 / 27,
            ("zb-v", 8): 3 / 51, ("dualpipev", 8): 3 / 51, ("1f1b", 8): 3 / 11}


def test_runtime_runs_each_schedule_as_written(worlds, capsys):
    """Each schedule through the runtime on 4 processes: the recorded order is the schedule's on every
    rank, every input existed before its consumer started, each rank posted exactly the schedule's
    sends and receives (and no other collective), held the simulator's activations (GPipe all m,
    1F1B at most p), and the recorded order re-timed with unit costs has the textbook bubble."""
    per_rank = worlds(P).run(run_schedules, RUNS, UNIT_S)
    report = []
    for i, (name, m, v) in enumerate(RUNS):
        timeline = [e for runs in per_rank for e in runs[i][0]]
        bubble = check_run(name, m, v, timeline, [runs[i][1] for runs in per_rank])
        assert all(abs(b - TEXTBOOK[(name, m)]) < 1e-12 for b in bubble), (name, m, bubble)
        held = peak_in_flight([e for e in timeline if e.kind in UNITS], P)
        if name == "gpipe":
            assert held == [m] * P
        if name == "1f1b":
            assert max(held) <= P
        report.append(f"{name} m={m}: bubble of the recorded order {max(bubble):.4f}, activations held {held}")
    zero_bubble = {name: TEXTBOOK[(name, m)] for name, m, _ in RUNS}
    assert zero_bubble["zb-v"] < TEXTBOOK[("1f1b", 8)] and zero_bubble["dualpipev"] < TEXTBOOK[("1f1b", 8)]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_retiming_sees_a_wrong_order():
    """The re-timing is not blind to order: GPipe's last rank running its backwards in reverse order
    makes the others wait longer, and 1F1B's forwards all first on one rank deadlock."""
    gpipe = build_schedule("gpipe", P, 8, 1)
    order = [[(a.kind, a.stage, a.mb) for a in actions if a.kind in UNITS] for actions in gpipe.ranks]
    last = [a for a in order[-1] if a[0] == "F"] + [a for a in order[-1] if a[0] == "B"][::-1]
    assert max(retimed_bubble([*order[:-1], last], P - 1)) > max(retimed_bubble(order, P - 1)) + 0.1
    one_f_one_b = build_schedule("1f1b", P, 8, 1)
    order = [[(a.kind, a.stage, a.mb) for a in actions if a.kind in UNITS] for actions in one_f_one_b.ranks]
    forwards_first = sorted(order[1], key=lambda a: a[0] == "B")
    try:
        retimed_bubble([order[0], forwards_first, *order[2:]], P - 1)
    except AssertionError as e:
        assert "deadlocks" in str(e)
    else:
        raise AssertionError("rank 1 waiting for forward 4 before sending backward 0 did not deadlock")
