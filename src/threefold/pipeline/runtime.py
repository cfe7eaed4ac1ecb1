"""The pipeline interpreter: executes any schedule's action list on this rank.

One loop for every schedule. Runs of consecutive SEND/RECV actions are posted as one
`Comm.batch_send_recv` on the "pp" axis (asynchronous: nothing waits at posting); a compute
action waits only for the one message it needs, so transfers overlap compute. On gloo (CPU)
every receive of the step is posted at its start, in the schedule's order: gloo's
point-to-point operations are independent (each matched by its peer in posting order, none
waiting for another), so a message lands while its consumer's rank is still computing, where
a receive posted at its place in the schedule leaves the transfer to start only then. NCCL
runs a communicator's operations in order on one stream, so there (and under
`debug.comm_semantics=nccl`) the receives stay at their places (posting.py). Activations
cross stages detached: the receiving stage makes its input a leaf and sends the leaf's
gradient back. Each micro-batch's backward adds into the parameters' `.grad` (gradient
accumulation); the data-parallel sync then runs once, after the whole schedule.

The arithmetic is the single-device step's: the last stage divides each micro-batch's summed
token loss by the global token count before backward, so the accumulated gradients are those
of the global mean loss. What a stage computes is behind `StageCompute` (pipeline/compute.py):
`ModuleCompute` runs the model; tests substitute stages of known cost to measure the schedule
itself. Every compute action is timed (after its input arrived) into `timeline`, by the
device's clock (`clock_for`).

Overlapped pairs (dualpipev with ep > 1, `pairs`): DeepSeek's point in pairing one micro-batch's
forward with another's backward is to hide each one's expert all-to-all behind the other's
computation. The runtime runs such a pair as one unit (`schedules.paired_schedule` moves the
communication between the two out and proves the result valid): both inputs first, then the
forward on this thread and the backward on a second one (`SideThread`), taking turns at every
expert exchange of their sparse blocks (pipeline/expert_overlap.py: the exchange posted
asynchronously through `Comm`, the turn passed, the wait when it comes back), then both outputs.
One side computes at a time, on its own stage's tensors, so the arithmetic is bit for bit the
serial pairs' (`overlap_pairs = False`: F, then B). `pair_overlap()` sums, from the times each
exchange was posted, waited for and completed, the share of their time hidden (pipeline/overlap.py).
It needs every collective inside a stage to be an expert exchange and no process-wide state the
sides share: tp = 1, no ZeRO-3, no activation checkpointing, no compiled stages
(schedules/registry.py `pair_overlap_blockers`, pipeline/split.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed

from ..comm import Comm
from ..schedules.actions import COMM, Action, Schedule
from . import overlap
from .compute import (Clock, CudaClock, HostClock, MicroState, ModuleCompute, StageCompute,  # noqa: F401 (their home)
                      carry_loss, clock_for, graph_leaves)
from .expert_overlap import DispatchSwitch, SideThread, Turns
from .stage import Stage
from .timeline import COMPUTE_KINDS, Event

RECEIVES = ("RECV_F", "RECV_B")


@dataclass
class InFlight:
    """What a run of the schedule leaves between its actions: posted receives, outputs waiting for their
    send, hand-offs between stages on this rank, forward states waiting for their backward, and sends
    not yet complete. A synchronous step starts one and finishes it; pipedream-2bw keeps one across steps."""

    inbox: dict = field(default_factory=dict)  # ("F"|"B", stage, mb) -> (handle, buffer) posted receives
    outbox: dict = field(default_factory=dict)  # ("F"|"B", stage, mb) -> tensor waiting for its SEND
    local: dict = field(default_factory=dict)  # hand-offs between stages on this rank
    states: dict = field(default_factory=dict)  # (stage, mb) -> what the forward left for the backward
    sending: list = field(default_factory=list)  # (handle, tensor): a tensor must live until its send completed

    def finish(self) -> None:
        """Wait for the sends; nothing may be left (the schedule ran every action it holds)."""
        for handle, _ in self.sending:
            handle.wait()
        self.sending = []
        assert not (self.inbox or self.outbox or self.local or self.states), "schedule left work undone"


def _wait(claim: tuple) -> torch.Tensor | None:
    handle, tensor = claim
    if handle is not None:
        handle.wait()
    return tensor


class PipelineRuntime:
    """Executes `schedule.ranks[rank]` for each training step (see the module docstring).

    `pairs`: this rank's (F, B) pairs to run as one unit (adjacent in `schedule`, which is then
    `schedules.paired_schedule`'s), overlapped while `overlap_pairs`; empty: one action at a time."""

    def __init__(self, schedule: Schedule, stages: list[Stage], compute: StageCompute, comm: Comm,
                 activation_shape, dtype: torch.dtype = torch.float32, tied_grads=None,
                 pairs: frozenset = frozenset()):
        self.schedule = schedule
        self.comm = comm
        self.rank = comm.mesh.rank("pp")
        self.stages = {s.index: s for s in stages}
        self.compute = compute
        self.activation_shape = activation_shape  # tokens shape -> shape of what crosses stages
        self.dtype = dtype
        self.tied_grads = tied_grads  # callable run after the schedule (sums tied weights' gradients)
        self.clock = clock_for(comm.mesh.device)
        self._marked: list[Event] = []  # the last step's actions, start and end as the clock's marks
        self._timeline: list[Event] | None = []
        self.meter = compute.meter
        self.actions = schedule.ranks[self.rank]
        assert {a.stage for a in self.actions} <= set(self.stages), "schedule and stages disagree"
        # gloo: every receive posted at the start of the step (module docstring)
        self.receives_first = comm.semantics == "native" and comm.mesh.device.type == "cpu"
        self._receives, self._rest = self.split_receives(self.actions)
        # compute kinds outside the shared vocabulary, run by a callable of the action (pipedream-2bw's U)
        self.own_actions: dict[str, Callable[[Action], None]] = {}
        self.pairs = pairs
        self.turns = Turns()
        self._side = SideThread() if pairs else None
        # the sparse blocks' dispatch: the paired one (pipeline/expert_overlap.py) under a paired schedule
        self.dispatch = (DispatchSwitch(compute.module, comm, self.turns)
                         if pairs and isinstance(compute, ModuleCompute) else None)
        if self.dispatch is not None:
            self.dispatch.use(True)
        self.overlap_pairs = bool(pairs)  # False: each pair's F, then its B (the exchanges waited at once)
        self._paired, self._exchanges, self._pair_count = overlap.Tally(), overlap.Tally(), 0

    def pair_overlap(self) -> dict:
        """Since the runtime began: the pairs run, and of the expert exchanges their sides issued the
        count, how many of them the other side computed beside, seconds in flight, seconds hidden and
        the fraction hidden (pipeline/overlap.py); under
        "step" the same over every exchange of the steps, paired or not."""
        return {"pairs": self._pair_count, **self._paired.to_dict(), "step": self._exchanges.to_dict()}

    def _tally_exchanges(self) -> None:
        log = self.dispatch.paired.log if self.dispatch is not None else ()
        while log:
            paired, *record = log.popleft()  # record: Tally.add's (switched, posted, wait, end)
            self._exchanges.add(*record)
            if paired:
                self._paired.add(*record)

    def take_tied_sum(self):
        """The tied weights' gradient sum, no longer run after the schedule: the caller runs it (after
        the dp exchange); None when no weight is tied."""
        tied, self.tied_grads = self.tied_grads, None
        return tied

    def _peer(self, stage: int) -> int:
        return self.schedule.stage_rank(stage)

    @property
    def timeline(self) -> list[Event]:
        """The last step's actions in seconds (perf_counter's scale; on CUDA this waits for the step)."""
        if self._timeline is None:
            seconds = self.clock.seconds([m for e in self._marked for m in (e.start, e.end)])
            self._timeline = [e._replace(start=seconds[2 * i], end=seconds[2 * i + 1])
                              for i, e in enumerate(self._marked)]
        return self._timeline

    def forward_backward(self, micro_batches, global_tokens: int) -> torch.Tensor:
        """Run the whole schedule over `micro_batches`; return this rank's summed token loss.

        Only the last stage has a loss; other ranks return 0 (the metrics sum over "pp").
        """
        if len(micro_batches) != self.schedule.microbatches:
            raise ValueError(f"the schedule expects {self.schedule.microbatches} micro-batches, got {len(micro_batches)}")
        self.compute.begin(global_tokens)
        flight = InFlight()
        loss = self.run_actions(self._receives, self._rest, micro_batches, flight)
        flight.finish()
        self._tally_exchanges()
        if self.tied_grads is not None:
            self.tied_grads()
        return loss + self.compute.side_loss

    def split_receives(self, actions) -> tuple[tuple, tuple]:
        """`actions` as (the receives posted at the start, the rest in order): on gloo every receive
        first (module docstring), else none apart."""
        if not self.receives_first:
            return (), tuple(actions)
        return (tuple(a for a in actions if a.kind in RECEIVES), tuple(a for a in actions if a.kind not in RECEIVES))

    def run_actions(self, receives, actions, micro_batches, flight: InFlight) -> torch.Tensor:
        """The one posting loop: post `receives`, then run `actions` in order - each run of transfers as
        one batch, each compute action once its input is here (`own_actions`: the kinds a schedule's
        runtime runs itself) - with what is in flight in `flight`; this rank's summed token loss.
        `micro_batches[i]`: micro-batch i (inputs, targets, a receive's shape)."""
        device = self.comm.mesh.device
        loss = torch.zeros((), dtype=torch.float32, device=device)
        timeline = self._marked = []
        self._timeline = None
        self.clock.begin()
        if receives:
            self._post(receives, micro_batches, flight.inbox, flight.outbox, device, timeline)
        n, i = len(actions), 0
        while i < n:
            a = actions[i]
            if a.kind in COMM:
                j = i
                while j < n and actions[j].kind in COMM:
                    j += 1
                flight.sending += self._post(actions[i:j], micro_batches, flight.inbox, flight.outbox, device, timeline)
                flight.sending = [(h, t) for h, t in flight.sending if not h.is_completed()]
                i = j
                continue
            if a.kind in self.own_actions:
                self.own_actions[a.kind](a)
                i += 1
                continue
            if a.kind == "F" and i + 1 < n and (a, actions[i + 1]) in self.pairs:
                self._pair(a, actions[i + 1], micro_batches, flight, loss, timeline)
                i += 2
                continue
            x = _wait(self._claim(a, micro_batches, flight.inbox, flight.local))
            state = flight.states.pop((a.stage, a.mb)) if a.kind in ("B", "W") else None
            out, start, end = self._compute(a, x, state, micro_batches, flight.states)
            self._deliver(a, out, loss, flight.outbox, flight.local)
            timeline.append(Event(self.rank, a.kind, a.stage, a.mb, start, end))
            i += 1
        return loss

    def _claim(self, a, micro_batches, inbox: dict, local: dict) -> tuple:
        """What compute action `a` starts from, as (handle to wait for or None, tensor): a forward's
        input, a backward's output gradient (None on the last stage), nothing for W."""
        stage = self.stages[a.stage]
        if a.kind == "F" and stage.first:
            return None, micro_batches[a.mb].inputs
        if a.kind == "W" or (a.kind != "F" and stage.last):
            return None, None
        key = ("F" if a.kind == "F" else "B", a.stage, a.mb)
        if key in local:
            return None, local.pop(key)
        return inbox.pop(key)

    def _compute(self, a, x, state, micro_batches, states: dict) -> tuple:
        """Run compute action `a` from `x` (B and W: with its popped `state`): (its output or None,
        start mark, end mark)."""
        stage = self.stages[a.stage]
        start = self.clock.mark()
        if a.kind == "F":
            out, states[(a.stage, a.mb)] = self.compute.forward(stage, x, micro_batches[a.mb].targets
                                                                if stage.last else None)
        elif a.kind == "B":
            out = self.compute.backward(stage, state, x)
        elif a.kind == "I":
            out = self.compute.backward_input(stage, states[(a.stage, a.mb)], x)
        else:
            out = self.compute.backward_weight(stage, state)
        return out, start, self.clock.mark()

    def _deliver(self, a, out, loss: torch.Tensor, outbox: dict, local: dict) -> None:
        """Where `a`'s output goes: the loss, a stage on this rank, or the outbox for its SEND."""
        stage = self.stages[a.stage]
        if a.kind == "F":
            if stage.last:
                loss += out
            elif self._peer(a.stage + 1) == self.rank:
                local[("F", a.stage + 1, a.mb)] = out
            else:
                outbox[("F", a.stage, a.mb)] = out
        elif a.kind in ("B", "I") and not stage.first:
            if self._peer(a.stage - 1) == self.rank:
                local[("B", a.stage - 1, a.mb)] = out
            else:
                outbox[("B", a.stage, a.mb)] = out

    def _pair(self, f, b, micro_batches, flight: InFlight, loss, timeline) -> None:
        """Forward `f` and backward `b` as one unit: both inputs first, both outputs after (as
        `paired_schedule` validated it); overlapped, `f` on this thread and `b` on the side thread
        taking turns at each expert exchange (pipeline/expert_overlap.py), else one after the other.
        Outputs and events as if run in turn."""
        inbox, outbox, local, states = flight.inbox, flight.outbox, flight.local, flight.states
        x = _wait(self._claim(f, micro_batches, inbox, local))
        grad = _wait(self._claim(b, micro_batches, inbox, local))
        b_state = states.pop((b.stage, b.mb)) if b.kind == "B" else None
        if self.overlap_pairs:
            self.turns.begin(["F", "B"])

            def backward():
                with self.turns.side("B"):
                    return self._compute(b, grad, b_state, micro_batches, states)

            future = self._side.submit(backward)
            with self.turns.side("F"):  # an exception here leaves the side thread to finish alone
                f_out, f_start, f_end = self._compute(f, x, None, micro_batches, states)
            b_out, b_start, b_end = future.result()
        else:
            f_out, f_start, f_end = self._compute(f, x, None, micro_batches, states)
            b_out, b_start, b_end = self._compute(b, grad, b_state, micro_batches, states)
        self._deliver(f, f_out, loss, outbox, local)
        self._deliver(b, b_out, loss, outbox, local)
        timeline.append(Event(self.rank, f.kind, f.stage, f.mb, f_start, f_end))
        timeline.append(Event(self.rank, b.kind, b.stage, b.mb, b_start, b_end))
        self._pair_count += 1

    def _post(self, batch, micro_batches, inbox, outbox, device, timeline) -> list:
        sends, recvs, recv_keys, send_tensors = [], [], [], []
        for a in batch:
            # on the wire in the runtime's dtype, so every receive buffer has the size its send has
            if a.kind == "SEND_F":
                t = outbox.pop(("F", a.stage, a.mb)).to(self.dtype).contiguous()
                sends.append((t, "pp", self._peer(a.stage + 1)))
            elif a.kind == "SEND_B":
                t = outbox.pop(("B", a.stage, a.mb)).to(self.dtype).contiguous()
                sends.append((t, "pp", self._peer(a.stage - 1)))
            else:
                shape = self.activation_shape(tuple(micro_batches[a.mb].inputs.shape))
                buffer = torch.empty(shape, dtype=self.dtype, device=device)
                src = self._peer(a.stage - 1 if a.kind == "RECV_F" else a.stage + 1)
                recvs.append((buffer, "pp", src))
                recv_keys.append((("F" if a.kind == "RECV_F" else "B", a.stage, a.mb), buffer))
                continue
            send_tensors.append(t)
        now = self.clock.mark()
        timeline.extend(Event(self.rank, a.kind, a.stage, a.mb, now, now) for a in batch)
        handles = self.comm.batch_send_recv(sends, recvs)
        for (key, buffer), handle in zip(recv_keys, handles[len(sends):]):
            inbox[key] = (handle, buffer)
        return list(zip(handles[:len(sends)], send_tensors))

    def gathered_timeline(self) -> list[Event]:
        """Every pp rank's compute events of the last step, on every rank (an all-gather over "pp")."""
        kinds = {k: i for i, k in enumerate(COMPUTE_KINDS)}
        rows = [[kinds[e.kind], e.stage, e.mb, e.start, e.end] for e in self.timeline if e.kind in kinds]
        device = self.comm.mesh.device
        count = torch.tensor([float(len(rows))], dtype=torch.float64, device=device)
        self.comm.all_reduce(count, "pp", op=torch.distributed.ReduceOp.MAX, tag="timeline")
        local = torch.full((int(count.item()), 5), -1.0, dtype=torch.float64, device=device)
        if rows:
            local[: len(rows)] = torch.tensor(rows, dtype=torch.float64, device=device)
        pp = self.comm.mesh.size("pp")
        gathered = torch.empty((pp * local.shape[0], 5), dtype=torch.float64, device=device)
        self.comm.all_gather(gathered, local, "pp")
        events = []
        for index, (kind, stage, mb, start, end) in enumerate(gathered.tolist()):
            if kind >= 0:
                events.append(Event(index // local.shape[0], COMPUTE_KINDS[int(kind)], int(stage), int(mb), start, end))
        return events


class RuntimeFactory(Protocol):
    """A schedule's own runtime (schedules/table.py `ScheduleKind.runtime`): the interpreter for this
    rank of `split` (pipeline/split.py `PipelineSplit`) in place of the shared one, reusing this
    module's posting loop (`PipelineRuntime.run_actions`); pipeline/two_bw.py `make_runtime` is one."""

    def __call__(self, split, comm: Comm, grad_sync, dtype: torch.dtype, weights: list[torch.Tensor] | None,
                 compile_stage) -> PipelineRuntime: ...
