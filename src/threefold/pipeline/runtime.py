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
of the global mean loss. What a stage computes is behind `StageCompute`: `ModuleCompute`
runs the model; tests substitute stages of known cost to measure the schedule itself.
Every compute action is timed (after its input arrived) into `timeline`, by the device's clock
(`clock_for`): CUDA events on CUDA, where the host only issues kernels and its own clock would
time the issuing, not the work; the host's clock on the CPU.

Overlapped pairs (dualpipev with ep > 1, `pairs`): DeepSeek's point in pairing one micro-batch's
forward with another's backward is to hide each one's expert all-to-all behind the other's
computation. The runtime runs such a pair as one unit (`schedules.paired_schedule` moves the
communication between the two out and proves the result valid): the backward on a second
thread (`_Worker`), inside `comm.lane("ep", PAIR)` so that every all-to-all it issues runs on
ep's second group, the forward on this thread on ep's own group. While one side waits for its
all-to-all (gloo and NCCL release the interpreter's lock while they wait), the other computes.
Each group sees one order on every rank (the same pairs, the same layers): no mismatch, and
every byte still goes through `Comm`, counted on ep. The two touch different stages' weights
(the backward only writes gradients, in the schedule's order), so the arithmetic is bit for
bit the sequential one's. Per pair the runtime keeps the host times of both sides and of the
all-to-alls each issued; `pair_overlap()` gives the time an all-to-all of one side was in
flight while the other side computed (pipeline/overlap.py). It needs every collective inside a
stage to be ep's all-to-all: tp = 1, no ZeRO-3, no activation checkpointing (whose
recomputation flag is process-wide), no compiled stages (pipeline/split.py decides).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed

from ..comm import Comm
from ..mesh import PAIR
from ..models.moe import MoE, routers_aux_loss
from ..observe.memory import SavedTensorMeter
from . import backward_split
from . import overlap
from .adapter import PipelineAdapter
from ..schedules.actions import COMM, Schedule
from .stage import RankModule, Stage
from .timeline import COMPUTE_KINDS, Event

RECEIVES = ("RECV_F", "RECV_B")


class Clock(Protocol):
    """Marks points of a step as the device reaches them; seconds of the marks, read after the step."""

    def begin(self) -> None: ...  # a new step

    def mark(self) -> object: ...

    def seconds(self, marks: list) -> list[float]: ...  # may wait for the device (after the step)


class HostClock:
    """The host's clock: on the CPU the device is the host, an action ends when its call returns."""

    def begin(self) -> None:
        return None

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list) -> list[float]:
        return [float(m) for m in marks]


class CudaClock:
    """Timing events on the current stream: when the device reached each mark, so an action's span
    is its kernels' and a wait for a message shows as a gap (the bubble). Seconds are the host's
    clock when the step's first mark was issued plus the device time elapsed since that mark;
    reading them waits for the step's last mark."""

    def __init__(self):
        self._first = self._last = None
        self._host0 = 0.0

    def begin(self) -> None:
        self._first = self._last = None

    def mark(self) -> object:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._first is None:
            self._first, self._host0 = event, time.perf_counter()
        self._last = event
        return event

    def seconds(self, marks: list) -> list[float]:
        if not marks:
            return []
        self._last.synchronize()
        return [self._host0 + self._first.elapsed_time(m) / 1e3 for m in marks]


def clock_for(device: torch.device) -> Clock:
    return CudaClock() if device.type == "cuda" else HostClock()


@dataclass
class MicroState:
    """What one (stage, micro-batch) keeps between its forward and its backward."""

    out: torch.Tensor | None  # stage output (or scaled loss on the last stage), in the graph until its backward
    inp: torch.Tensor | None  # leaf input whose gradient goes to the previous stage (None: first stage)
    groups: list = field(default_factory=list)  # saved for the weight gradient (split backward)
    grad: torch.Tensor | None = None  # first stage, split backward: the output gradient W starts from
    nbytes: int = 0  # activation bytes autograd saved for backward


class StageCompute(Protocol):
    meter: SavedTensorMeter | None  # activation bytes of the stages in flight (None: not measured)
    side_loss: torch.Tensor | float  # the step's loss terms of stages before the last (summed into the loss)

    def begin(self, global_tokens: int) -> None: ...
    def forward(self, stage: Stage, x: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, object]:
        """(output to pass on - the detached summed loss on the last stage -, state for backward)."""
    def backward(self, stage: Stage, state, grad: torch.Tensor | None) -> torch.Tensor | None: ...
    def backward_input(self, stage: Stage, state, grad: torch.Tensor | None) -> torch.Tensor | None: ...
    def backward_weight(self, stage: Stage, state) -> None: ...


class ModuleCompute:
    """Runs the stages of a `RankModule`; gradients accumulate into `.grad` inside `grad_sync`."""

    def __init__(self, module: RankModule, adapter: PipelineAdapter, grad_sync=None,
                 meter: SavedTensorMeter | None = None, compile_stage=None):
        self.module = module
        # `train.compile`: the stage's computation as one torch.compile region (parallel/compile.py)
        self.run_stage = compile_stage(self.run_stage) if compile_stage is not None else self.run_stage
        self.adapter = adapter
        self.grad_sync = grad_sync
        self.meter = meter
        self.scale = 1
        self.held = 0  # activation bytes held right now
        self._held_lock = threading.Lock()  # an overlapped pair's backward runs on another thread
        self.side_loss: torch.Tensor | float = 0.0  # this step's auxiliary losses of stages without the loss
        self._params = {}
        self._plans: dict = {}  # stage index -> its graph's weight groups (backward_split.py)
        self._routed: dict[int, bool] = {}  # stage index -> has routed experts (models/moe.py)

    def begin(self, global_tokens: int) -> None:
        self.scale = global_tokens
        self.held = 0
        self.side_loss = 0.0

    def _weights(self, stage: Stage, state: MicroState) -> list[torch.nn.Parameter]:
        """The trainable leaves a split stage's graph uses (not its input). Read from the graph
        rather than from the modules: a strategy may hold other objects in the modules between uses
        (ZeRO-3's shards while the graph refers to the whole parameters). The same objects serve
        every micro-batch."""
        if stage.index not in self._params:
            self._params[stage.index] = graph_leaves(state.out, exclude=state.inp)
        return self._params[stage.index]

    def forward(self, stage, x, targets):
        meter = self.meter
        if meter is None:
            return self._forward(stage, x, targets)
        (out, state), state.nbytes = meter.count(self._meter_key(stage, x), lambda: self._forward(stage, x, targets))
        with self._held_lock:
            self.held += state.nbytes
            meter.peak = max(meter.peak, self.held)
        return out, state

    def _release(self, state: MicroState) -> None:
        with self._held_lock:
            self.held -= state.nbytes

    def _meter_key(self, stage: Stage, x: torch.Tensor):
        """What fixes the bytes a stage's forward saves: the stage and its input's shape and dtype;
        None (measure every time) for a stage with routed experts, whose saved shapes follow the routing."""
        if stage.index not in self._routed:
            self._routed[stage.index] = any(isinstance(m, MoE) for i in stage.layers for m in self.module.layer(i).modules())
        return None if self._routed[stage.index] else (stage.index, tuple(x.shape), x.dtype)

    def run_stage(self, stage: Stage, x: torch.Tensor, targets) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's computation: (embedding,) its layers (, norm, head and summed token loss) ->
        (output or summed loss, the stage's routers' auxiliary losses (models/moe.py) or None)."""
        if stage.first:  # the embedding stays in the graph: nothing needs the token ids' gradient
            x = self.adapter.embed(self.module, x)
        layers = [self.module.layer(i) for i in stage.layers]
        for layer in layers:
            x = layer(x)
        aux = routers_aux_loss(layers)
        if stage.last:
            x = self.adapter.head_loss(self.module, x, targets)
        return x, aux

    def _forward(self, stage: Stage, x: torch.Tensor, targets):
        inp = None if stage.first else x.requires_grad_()
        x, aux = self.run_stage(stage, x, targets)
        if stage.last:
            loss_sum = x if aux is None else x + aux
            return loss_sum.detach(), MicroState(loss_sum / self.scale, inp)
        if aux is not None:  # into this stage's backward (as the loss's share) and the step's loss
            self.side_loss = self.side_loss + aux.detach().float()
            x = carry_loss(x, aux / self.scale)
        return x.detach(), MicroState(x, inp)

    def _sync(self):
        # every backward accumulates locally; the gradient sync runs once after the schedule
        return self.grad_sync.micro_batch(last=False) if self.grad_sync is not None else _nullcontext()

    def backward(self, stage, state: MicroState, grad):
        with self._sync():
            torch.autograd.backward(state.out, grad)
        self._release(state)
        return None if stage.first else state.inp.grad

    def backward_input(self, stage, state: MicroState, grad):
        # the stage input's gradient only; what the weight gradients need is kept in `groups`
        # (backward_split.py). The first stage sends no input gradient: nothing waits for its I,
        # so its W runs the whole backward and the split's extra work is skipped (as torch's
        # schedules do)
        if stage.first:
            state.grad = grad
            return None
        with self._sync():
            self._weights(stage, state)  # ZeRO-3's gather in W needs them; read while the graph is whole
            dinput, state.groups = backward_split.backward_input(state.out, grad, state.inp, self._plans, stage.index)
        state.out = None  # the groups keep what W needs of the graph
        return dinput

    def backward_weight(self, stage, state: MicroState) -> None:
        if stage.first:
            self.backward(stage, state, state.grad)
            return
        weights = self._weights(stage, state)
        with self._sync():
            if self.grad_sync is not None:  # ZeRO-3: no module hook runs here, the weights must be whole
                self.grad_sync.gather_for(weights)
            backward_split.backward_weight(state.groups)
        state.groups = []
        self._release(state)


class _CarryLoss(torch.autograd.Function):
    """Forward: `x` unchanged; backward: `x`'s gradient, and 1 for `loss` (a term of the loss
    computed on a stage before the last, e.g. the routers' auxiliary losses)."""

    @staticmethod
    def forward(ctx, x, loss):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        one = torch.ones((), dtype=torch.float32, device=grad.device) if ctx.needs_input_grad[1] else None
        return grad, one


def carry_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    return _CarryLoss.apply(x, loss)


def graph_leaves(out: torch.Tensor, exclude: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Leaves requiring grad that `out`'s autograd graph accumulates into, in discovery order."""
    leaves, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            if variable is not exclude:
                leaves.append(variable)
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _Worker:
    """A daemon thread running one function at a time (an overlapped pair's backward), started at
    its first use; daemon: a failed step never keeps the process alive waiting for it."""

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


def _wait(claim: tuple) -> torch.Tensor | None:
    handle, tensor = claim
    if handle is not None:
        handle.wait()
    return tensor


class PipelineRuntime:
    """Executes `schedule.ranks[rank]` for each training step (see the module docstring).

    `pairs`: this rank's (F, B) pairs to run at once (adjacent in `schedule`, which is then
    `schedules.paired_schedule`'s), their all-to-alls on two ep groups; empty: one action at a time."""

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
        self._receives = tuple(a for a in self.actions if a.kind in RECEIVES)
        self._rest = tuple(a for a in self.actions if a.kind not in RECEIVES)
        self.pairs = pairs
        self._worker = _Worker() if pairs else None
        self._pair_times: list = []  # (PairTimes, forward records, backward records) not yet tallied
        self._overlap = overlap.Tally()

    def pair_overlap(self) -> dict:
        """The overlapped pairs since the runtime began: their count, the seconds their all-to-alls
        were in flight, the seconds of that the other side computed, and the fraction hidden
        (pipeline/overlap.py). A pair whose all-to-alls have not all completed waits for the next call."""
        self.comm.poll()
        pending = []
        for times, forward, backward in self._pair_times:
            if any(r.end is None for r in forward + backward):
                pending.append((times, forward, backward))
                continue
            times.forward_comm = [(r.start, r.end) for r in forward]
            times.backward_comm = [(r.start, r.end) for r in backward]
            self._overlap.add(times)
        self._pair_times = pending
        return self._overlap.to_dict()

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
        device = self.comm.mesh.device
        self.compute.begin(global_tokens)
        loss = torch.zeros((), dtype=torch.float32, device=device)
        inbox: dict[tuple, tuple] = {}  # ("F"|"B", stage, mb) -> (handle, buffer) posted receives
        outbox: dict[tuple, torch.Tensor] = {}  # ("F"|"B", stage, mb) -> tensor waiting for its SEND
        local: dict[tuple, torch.Tensor] = {}  # hand-offs between stages on this rank
        states: dict[tuple, object] = {}
        sending: list = []  # (handle, tensor): a tensor must live until its send completed
        timeline = self._marked = []
        self._timeline = None
        self.clock.begin()
        actions = self.actions
        if self.receives_first and self._receives:
            self._post(self._receives, micro_batches, inbox, outbox, device, timeline)
            actions = self._rest
        n, i = len(actions), 0
        while i < n:
            a = actions[i]
            if a.kind in COMM:
                j = i
                while j < n and actions[j].kind in COMM:
                    j += 1
                sending += self._post(actions[i:j], micro_batches, inbox, outbox, device, timeline)
                sending = [(h, t) for h, t in sending if not h.is_completed()]
                i = j
                continue
            if a.kind == "F" and i + 1 < n and (a, actions[i + 1]) in self.pairs:
                self._pair(a, actions[i + 1], micro_batches, inbox, outbox, local, states, loss, timeline)
                i += 2
                continue
            x = _wait(self._claim(a, micro_batches, inbox, local))
            state = states.pop((a.stage, a.mb)) if a.kind in ("B", "W") else None
            out, start, end = self._compute(a, x, state, micro_batches, states)
            self._deliver(a, out, loss, outbox, local)
            timeline.append(Event(self.rank, a.kind, a.stage, a.mb, start, end))
            i += 1
        for handle, _ in sending:
            handle.wait()
        assert not (inbox or outbox or local or states), "schedule left work undone"
        if self.tied_grads is not None:
            self.tied_grads()
        return loss + self.compute.side_loss

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

    def _pair(self, f, b, micro_batches, inbox, outbox, local, states, loss, timeline) -> None:
        """Forward `f` here and backward `b` on the worker at once (module docstring); outputs and
        events as if run one after the other."""
        f_claim, b_claim = self._claim(f, micro_batches, inbox, local), self._claim(b, micro_batches, inbox, local)
        b_state = states.pop((b.stage, b.mb)) if b.kind == "B" else None
        records = self.comm.records
        seen = records[-1].seq if records else 0

        def backward():
            with self.comm.lane("ep", PAIR):
                grad = _wait(b_claim)
                began = time.monotonic()
                result = self._compute(b, grad, b_state, micro_batches, states)
                return result, (began, time.monotonic())

        future = self._worker.submit(backward)
        x = _wait(f_claim)  # an exception here leaves the worker to its daemon thread
        began = time.monotonic()
        f_out, f_start, f_end = self._compute(f, x, None, micro_batches, states)
        f_span = (began, time.monotonic())
        (b_out, b_start, b_end), b_span = future.result()
        self._deliver(f, f_out, loss, outbox, local)
        self._deliver(b, b_out, loss, outbox, local)
        timeline.append(Event(self.rank, f.kind, f.stage, f.mb, f_start, f_end))
        timeline.append(Event(self.rank, b.kind, b.stage, b.mb, b_start, b_end))
        issued = itertools.takewhile(lambda r: r.seq > seen, reversed(records))
        a2a = [r for r in issued if r.axis == "ep" and r.op.startswith("all_to_all")]
        self._pair_times.append((overlap.PairTimes(f_span, b_span), [r for r in a2a if r.lane != PAIR],
                                 [r for r in a2a if r.lane == PAIR]))

    def _take(self, key: tuple, inbox: dict, local: dict) -> torch.Tensor:
        """The input (F) or output gradient (B) of a stage: a local hand-off or a received buffer."""
        if key in local:
            return local.pop(key)
        handle, buffer = inbox.pop(key)
        handle.wait()
        return buffer

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
