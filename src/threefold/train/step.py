"""The math of one optimizer step, independent of the layout.

loss = (sum over every token of the global batch of -log p) / (tokens in the global batch).
Each rank runs its micro-batches, dividing each micro-batch's summed loss by the *global*
token count before backward, so the gradients summed by the gradient sync are exactly the
gradient of that mean. Then: global gradient norm, clipping, learning rate, optimizer update.

Packed rows (`data.pack`): the targets that do not count (padding, each document's last token,
whose target is the next document's first) become `IGNORE_INDEX` and add nothing; the count is
that of the global batch's counted targets (this rank's, summed over the batch and sequence axes,
dp and cp, in one collective: `all_reduce.tokens`), and before each micro-batch's forward the
model gets its document ids and positions (`ParallelModel.documents`).

No host synchronisation: the norm, the overflow flag, the loss scale and the loss stay on the
device; one flag decides skip or step inside the optimizer's kernel (parallel/master.py), and
the trainer reads the step's figures once (`StepResult.figures`, `start_read`): their copy to the
host is issued (non-blocking, into pinned memory on CUDA) with an event right after the step, and
the host waits for that event alone, after it has issued the next step.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..comm import Comm
from ..config import TrainConfig
from ..data import Batch
from ..mesh import BATCH, PIPELINE, REPLICA, SEQUENCE, TENSOR
from ..models.cross_entropy import IGNORE_INDEX
from ..parallel import GradSync, ParallelModel, accumulate  # noqa: F401  (accumulate, GradSync: re-exported)
from ..parallel.model import Documents
from ..parallel.context import split_micro_batch
from ..parallel.master import ShardedOptimizer
from ..schedules.table import kind
from ..sharding import Placement
from .optim import lr_at, set_lr

if TYPE_CHECKING:
    from .clock import Mark
    from ..comm.collectives import Handle


class Event(Protocol):
    """A point in the device's queue (`torch.cuda.Event`)."""

    def synchronize(self) -> None: ...  # returns once the device has passed the point


class Device(Protocol):
    """The device operations of reading a step's figures back, and of its memory peak: a seam
    (`TorchDevice` on the trainer's device; a test records the order of their calls)."""

    def host_buffer(self, numel: int) -> torch.Tensor: ...  # float64 host memory the copy lands in

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # issued, not waited for

    def record_event(self) -> Event: ...  # after everything issued so far

    def memory_peak(self) -> int | None: ...  # the allocator's peak since the last reset (None: not tracked)

    def reset_memory_peak(self) -> None: ...


class _Passed:
    """The event of a device without a queue (the CPU): every copy has happened when issued."""

    def synchronize(self) -> None:
        return None


class TorchDevice:
    """`Device` for a torch device. CUDA: pinned host memory, `copy_(non_blocking=True)` and a CUDA
    event on the current stream, so the copy is queued behind the step and the host does not wait;
    the caching allocator's peak. CPU: plain memory, the copy happens at once, no peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def host_buffer(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float64, pin_memory=self.cuda)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    def record_event(self) -> Event:
        if not self.cuda:
            return _Passed()
        event = torch.cuda.Event()
        event.record()
        return event

    def memory_peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def reset_memory_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)


Figure = torch.Tensor | float  # a 0-dim device tensor, or a number the host already knows


class PendingRead:
    """Figures whose copy to the host is issued; `values()` waits for that copy alone."""

    def __init__(self, names: list[str], known: dict[str, float], host: torch.Tensor | None, done: Event | None,
                 order: list[str]):
        self._names, self._known, self._host, self._done, self._order = names, known, host, done, order

    def values(self) -> dict[str, float]:
        """{name: number}, in the order the figures were given."""
        read = {}
        if self._host is not None:
            self._done.synchronize()
            read = dict(zip(self._names, self._host.tolist()))  # host memory: no device access
        return {name: read[name] if name in read else self._known[name] for name in self._order}


def start_read(figures: dict[str, Figure], device: Device) -> PendingRead:
    """Issue the one copy of a step's device figures to the host and an event behind it.

    Issued right after the step, before anything of the next one, so the copy waits for this step
    only; numbers the host already knows are kept as they are (no host-to-device copy)."""
    tensors = {k: v for k, v in figures.items() if isinstance(v, torch.Tensor)}
    known = {k: float(v) for k, v in figures.items() if not isinstance(v, torch.Tensor)}
    host = done = None
    if tensors:
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in tensors.values()])
        host = device.host_buffer(len(tensors))
        device.copy_to_host(host, stacked)
        done = device.record_event()
    return PendingRead(list(tensors), known, host, done, list(figures))


class PostedRead:
    """A step's figures behind a posted (asynchronous) reduction: `values()` waits for it, then reads
    them as `step.start_read` does. pipedream-2bw's metrics reduction over pp is posted at the end of
    a step and waited for when the step's record is made, after the next step is launched (the
    `TwoBWStep.reduce_figures`), so no pipeline rank waits for another at the step boundary.

    `figures()` builds the figures from the reduced tensors: called after the wait (on CUDA the
    wait orders the stream, so what it computes follows the reduction)."""

    def __init__(self, posted: Handle, figures: Callable[[], dict[str, Figure]], device: Device):
        self._posted, self._figures, self._device = posted, figures, device

    def values(self) -> dict[str, float]:
        self._posted.wait()
        return start_read(self._figures(), self._device).values()


@dataclass
class StepResult:
    """A step's figures as 0-dim device tensors (reading them waits for the step)."""

    loss_sum: torch.Tensor  # this rank's summed token loss (fp32)
    grad_norm: torch.Tensor  # the global gradient norm (fp32; inf or nan after an overflow)
    lr: float
    skipped: torch.Tensor  # bool: the update was skipped (non-finite gradients)
    loss_scale: torch.Tensor | float = 1.0  # the loss scale this step used (fp16: on the device)
    # the targets the loss is the mean over: train.global_batch x train.seq_len, or (packed rows) the
    # counted targets of the global batch, on the device
    targets: torch.Tensor | float | None = None

    def figures(self) -> dict[str, Figure]:
        """What the metrics read of the step; callers add their own (the loss over the world, ...)."""
        return {"grad_norm": self.grad_norm, "skipped": self.skipped, "loss_scale": self.loss_scale}

    def read(self, *extra: torch.Tensor) -> list[float]:
        """Wait for the step: [grad_norm, skipped, loss_scale, *extra] as numbers (one transfer)."""
        figures = {**self.figures(), **{f"extra{i}": v for i, v in enumerate(extra)}}
        return list(start_read(figures, TorchDevice(self.grad_norm.device)).values().values())


def global_grad_norm(params: list[nn.Parameter], placements: list[Placement], comm: Comm,
                     dp_axis: str | None = "", replicated: bool = False,
                     norms: list[torch.Tensor] | None = None) -> torch.Tensor:
    """sqrt of the sum of squares of every distinct gradient element of the global model
    (`grad_sum_of_squares` summed over tp, pp and the replica axes; `dp_axis` "": the mesh's)."""
    inner_first = tuple(reversed(comm.mesh.axes_where(TENSOR, PIPELINE)))  # tp, then pp
    return grad_sum_of_squares(params, placements, comm, dp_axis if dp_axis != "" else comm.mesh.replica_axis,
                               replicated, inner_first, norms).sqrt()


def grad_sum_of_squares(params: list[nn.Parameter], placements: list[Placement], comm: Comm,
                        dp_axis: str | None, replicated: bool, axes: tuple[str, ...],
                        norms: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The sum of squares of every distinct gradient element, summed over `axes` and the replica axes.

    Each rank adds the gradients it owns - a copy replicated over an axis counts only at that
    axis's coordinate 0 - and the partial sums are added over every mesh axis, so shards,
    stages and replicas of any layout give the single-device norm. `dp_axis` stands for the
    replica axes (the mesh's `replica_axis`: dp, or dp+cp in one collective): between the syncs
    of local SGD a replica's own norm is over its inner axis (or none).

    `replicated`: the gradient sync left bitwise the same whole gradients on every replica (a
    dense sum). Then every rank adds them all itself and nothing is summed over the replica axes -
    one collective less per step, as DDP's replicas clip locally - with the value the sum gives
    (coordinate 0's partial sum plus zeros).

    `norms`: each parameter's gradient norm, given where the gradients are not on `.grad` (streamed
    from a scratch file); combined as torch's `get_total_norm` combines the per-tensor norms.
    """
    mesh = comm.mesh
    replicas, joined = mesh.axes_where(REPLICA), mesh.replica_axis
    wide = [axis for axis in replicas if mesh.size(axis) > 1]
    local_dp = dp_axis == joined and replicated and all(a in place.replicated_over for place in placements
                                                        for a in wide)

    def owns(axis: str) -> bool:
        if axis in wide:  # the replica axes: `dp_axis` stands for them (one coordinate each when theirs)
            return dp_axis is None or local_dp or mesh.rank(axis if dp_axis == joined else dp_axis) == 0
        return mesh.rank(axis) == 0

    mine = [i for i, (p, place) in enumerate(zip(params, placements))
            if (p.grad is not None or norms is not None) and all(owns(axis) for axis in place.replicated_over)]
    # on the mesh's device: the collective needs it (offloaded master gradients live on the host)
    sumsq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    if mine and norms is not None:
        total = torch.linalg.vector_norm(torch.stack([norms[i] for i in mine]), 2.0)
        sumsq += total.float().square().to(mesh.device)
    elif mine:
        owned = [params[i].grad for i in mine]
        sumsq += torch.nn.utils.get_total_norm(owned, foreach=True).float().square().to(mesh.device)
    for axis in (*axes, None if local_dp else dp_axis):
        if axis is not None:
            comm.all_reduce(sumsq, axis, tag="grad_norm")
    return sumsq


def split_sequences(micro_batches: list[Batch], comm: Comm, packed: bool = False) -> list[Batch]:
    """Under context parallelism (cp > 1) this rank's zigzag part of every micro-batch's sequences
    (inputs and targets alike: each target stays with its input; packed rows' document ids and
    positions too); the global token count is unchanged, the loss is summed over the batch and
    sequence axes (dp, cp). `packed` (data.pack: every micro-batch carries its `Packing`): the
    targets that do not count become IGNORE_INDEX. Neither: the micro-batches as they are."""
    cp = comm.mesh.size("cp")
    if cp == 1 and not packed:
        return micro_batches
    out = []
    for mb in micro_batches:
        if packed:
            if mb.packing is None:
                raise ValueError("data.pack: a micro-batch carries no packing")
            mb = Batch(mb.inputs, mb.targets.masked_fill(~mb.packing.counted, IGNORE_INDEX), mb.packing)
        if cp > 1:
            mb = mb.map(lambda t: split_micro_batch(t, comm, "cp"))
        out.append(mb)
    return out


def counted_targets(micro_batches: list[Batch], comm: Comm, reduce: bool = True) -> torch.Tensor:
    """The counted targets of packed micro-batches (int64, 0-dim): this rank's, summed over the batch and
    sequence axes (dp, cp) in one collective (`all_reduce.tokens`) unless `reduce` is false."""
    count = torch.stack([mb.packing.counted.sum() for mb in micro_batches]).sum()
    if reduce:
        comm.all_reduce_over(count, comm.mesh.axes_where(BATCH, SEQUENCE), tag="tokens")
    return count


def hand_documents(documents: Documents, mb: Batch) -> None:
    """Give the model micro-batch `mb`'s document ids and positions (packed rows) before its forward."""
    if mb.packing is None:
        raise ValueError("the model masks by document (data.pack) but a micro-batch carries no packing")
    documents.set(mb.packing.documents, mb.packing.positions)


class TrainStep:
    """forward/backward -> gradient sync -> norm and clip -> optimizer step, for one step.

    Forward and backward are the parallel model's (`ParallelModel.forward_backward`: plain
    accumulation or the pipeline schedule). The optimizer is the one `ParallelModel.make_optimizer`
    built (parallel/master.py: fp32 masters, shards, offload): the norm and the clipping act on
    the fp32 master gradients of the pieces this rank owns (`prepare_grads`, after dividing by the
    loss scale); a step with a non-finite norm changes nothing (`step(found_inf)`, on the device).
    """

    def __init__(self, parallel: ParallelModel, optimizer: ShardedOptimizer, comm: Comm, cfg: TrainConfig):
        self.parallel = parallel
        self.grad_sync = parallel.grad_sync
        self.optimizer = optimizer
        self.comm = comm
        self.cfg = cfg
        self.scaler = parallel.scaler  # parallel/precision.py DynamicLossScaler (fp16) or None
        if self.scaler is not None:
            self.scaler.to(comm.mesh.device)
        self.meter = parallel.meter

    def split_sequences(self, micro_batches: list[Batch]) -> list[Batch]:
        return split_sequences(micro_batches, self.comm, self.parallel.documents is not None)

    def drain(self) -> None:
        """Nothing is in flight between synchronous steps (pipedream-2bw's step drains its pipeline here)."""

    def reduce_figures(self, result: StepResult, reduced: torch.Tensor, extra: dict[str, Figure],
                       device: Device) -> PendingRead | PostedRead:
        """The step's metrics over the world, on their way to the host: `reduced` ([this rank's summed
        loss, stop flag]) summed over pp (only the last stage has a loss), the token shards (dp, cp) and
        tp (the flag reaches every rank; the loss, equal on every tp rank, counts once), then one copy
        of it with the step's figures and `extra`, issued before anything of the next step."""
        mesh = self.comm.mesh
        axes = [mesh.axes_where(PIPELINE), mesh.axes_where(BATCH, SEQUENCE)]
        if mesh.size("tp") > 1:
            axes.append(mesh.axes_where(TENSOR))
            if mesh.rank("tp") > 0:
                reduced[0] = 0
        for over in axes:
            self.comm.all_reduce_over(reduced, over, tag="metrics")
        targets = {} if result.targets is None else {"targets": result.targets}
        return start_read({**result.figures(), "loss_total": reduced[0], "stop": reduced[1], **extra, **targets},
                          device)

    def __call__(self, step: int, micro_batches: list[Batch], global_tokens: int) -> StepResult:
        """Run optimizer step `step` (1-based)."""
        # fp16: the scaler's device tensor, copied (the update below changes it in place)
        scale = self.scaler.scale_tensor.clone() if self.scaler is not None else 1.0
        if self.parallel.periodic is not None:  # local SGD: whether this step sums gradients over dp
            self.parallel.periodic.begin_step(step)
        self.grad_sync.zero_grad()
        micro_batches = self.split_sequences(micro_batches)
        documents, before, targets = self.parallel.documents, None, global_tokens
        if documents is not None:  # packed rows: the counted targets, each micro-batch's ids and positions
            targets = counted_targets(micro_batches, self.comm).clamp_min(1)
            before = lambda mb: hand_documents(documents, mb)  # noqa: E731
        loss_sum = self.parallel.forward_backward(micro_batches, targets, scale, before)
        self.grad_sync.finish()
        if self.parallel.after_sync is not None:
            self.parallel.after_sync()
        params, placements = self.optimizer.prepare_grads(1.0 / scale)
        norm = global_grad_norm(params, placements, self.comm, self.parallel.norm_axis, self.grad_sync.replicated,
                                self.optimizer.grad_norms())
        # the norm is summed over every mesh axis: every rank sees the same value, hence the same decision
        found_inf = ~torch.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self.optimizer.clip(params, norm, self.cfg.grad_clip)  # non-finite gradients stay non-finite: skipped below
        lr = lr_at(step, self.cfg)
        set_lr(self.optimizer, lr)
        self.optimizer.step(found_inf)  # the update is skipped on the device where found_inf is set
        return StepResult(loss_sum, norm, lr, found_inf, scale, targets if documents is not None else None)


@dataclass
class LaunchedStep:
    """A step issued to the device whose figures are not read yet (`Trainer.finish_step`)."""

    step: int
    result: StepResult
    figures: PendingRead | PostedRead  # the step's figures on their way to the host (`Trainer.figures`; with "stop":
    # how many ranks had a stop signal when the step was launched, train/preempt.py)
    start: Mark  # when its launch began, and when its work ended (train/clock.py)
    end: Mark
    local_tokens: int
    data_wait_s: float
    save_wait_s: float  # its update waiting for the snapshot of an async save (inside its time)
    mem: dict  # the memory figures at its launch
    moe: dict | None
    comm: dict  # the step's bytes by axis and op
    mtp: torch.Tensor | None = None  # multi-token prediction's figures summed over dp and cp (models/mtp.py)


class Step(Protocol):
    """A training step as the trainer drives it: `TrainStep`, or a schedule's own (pipedream-2bw's)."""

    def __call__(self, step: int, micro_batches: list[Batch], global_tokens: int) -> StepResult: ...

    def drain(self) -> None: ...  # nothing left in flight: before a save and at the end

    def reduce_figures(self, result: StepResult, reduced: torch.Tensor, extra: dict[str, Figure],
                       device: Device) -> PendingRead | PostedRead: ...  # the step's metrics (`TrainStep`'s)


class StepFactory(Protocol):
    """What a schedule's registration names as its step (schedules/table.py `ScheduleKind.step`)."""

    def __call__(self, parallel: ParallelModel, optimizer: ShardedOptimizer, comm: Comm, cfg: TrainConfig) -> Step: ...


def make_step(parallel: ParallelModel, optimizer: ShardedOptimizer, comm: Comm, cfg: TrainConfig) -> Step:
    """The run's training step: the one its pipeline schedule's registration names (`ScheduleKind.step`,
    imported only then), else `TrainStep`."""
    factory: StepFactory = TrainStep
    if parallel.pipeline is not None:
        hook = kind(parallel.pipeline.schedule.name).step
        if hook is not None:
            factory = pkgutil.resolve_name(hook)
    return factory(parallel, optimizer, comm, cfg)
