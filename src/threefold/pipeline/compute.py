"""What a pipeline stage computes, and the clocks that time it (pipeline/runtime.py runs the schedule).

`StageCompute` separates the interpreter from the computation: `ModuleCompute` runs a
`RankModule`'s stages (embedding, layers, head and loss; forward, backward, and the split
backward's I and W of backward_split.py), keeping the activation bytes in flight; tests plug
in stages of known cost. The last stage divides each micro-batch's summed token loss by the
global token count before backward; a stage before the last carries its routers' auxiliary
losses into its backward (`carry_loss`). Every compute action is timed by the device's clock
(`clock_for`): CUDA events on CUDA, where the host only issues kernels and its own clock would
time the issuing, not the work; the host's clock on the CPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..models.moe import MoE, routers_aux_loss
from ..observe.memory import SavedTensorMeter
from . import backward_split
from .adapter import PipelineAdapter
from .stage import RankModule, Stage

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
