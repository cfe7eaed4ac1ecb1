"""`ParallelModel`: this rank's part of the model with everything that acts on it.

What `parallelize()` returns and the trainer drives: the local module and placements, the
gradient sync over dp (one complete Protocol, `GradSync`), `forward_backward` (plain gradient
accumulation, or the pipeline schedule when pp > 1), the optimizer it needs
(`make_optimizer`: fp32 masters over this rank's pieces, AdamW / momentum SGD, or 1-bit Adam
when the compression asks for it) and the extra state a checkpoint carries (`stateful`,
`rank_state`). The trainer only loops, logs and saves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..config import TrainConfig
from ..observe.memory import SavedTensorMeter
from .remat import ActivationOffload
from ..models.spec import is_state_buffer
from ..sharding import Placement
from .master import Piece, ShardedOptimizer
from .nvme import NvmeOptimizer, ScratchSettings, ShardStore
from .precision import MixedPrecision


class GradSync(Protocol):
    """Gradient communication over dp: plain data parallelism (data.py) or a ZeRO stage (zero.py, zero3.py)."""

    applies_momentum: bool  # the exchange already applied the optimizer's momentum (DGC's correction)
    replicated: bool  # after finish() every dp rank holds bitwise the same whole gradients

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager: ...  # around one backward

    def finish(self) -> None: ...  # after the last backward: complete every reduction

    def zero_grad(self) -> None: ...

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor: ...  # where its gradient is held now

    def gradient_tensors(self) -> list[torch.Tensor]: ...  # gradient storage (memory accounting)

    def weight_tensors(self) -> list[torch.Tensor]: ...  # weight storage besides the module's parameters

    def gather_for(self, params: list[nn.Parameter]) -> None: ...  # whole weights for a hook-less backward

    def state_dict(self) -> dict[str, torch.Tensor]: ...  # this rank's own state (compression residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def optimizer_for(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """What the compression needs in place of the torch optimizer over the masters (1-bit Adam)."""

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` before the sync changes in place what a checkpoint reads (checkpoint.state.UpdateGuard):
        its per-rank state, or the parameters (ZeRO-1/2's all-gathers of the updated shards)."""


class Periodic(Protocol):
    """Periodic synchronisation over dp (local SGD, DiLoCo, EASGD: local_sgd.py): when the replicas
    meet, and the optimizer that meets them when a period ends."""

    @property
    def norm_axis(self) -> str | None: ...  # the axis standing for dp in this step's gradient norm

    def begin_step(self, step: int) -> None: ...  # before the step's backward: local or summed over dp

    def make_optimizer(self, pieces: list[Piece], cfg: TrainConfig, fp32_init: dict[str, torch.Tensor],
                       offload: bool, after_step: Callable[[], None] | None) -> ShardedOptimizer: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...  # this rank's replica masters and moments

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None: ...  # before the replica state changes


class Documents(Protocol):
    """Packed rows (`data.pack`, parallel/context.py `PackedDocuments`): the model's attention masks by
    document and its positions restart per document; `set` hands it one micro-batch's (local) ids and
    positions (b, s) before that micro-batch's forward."""

    def set(self, documents: torch.Tensor, positions: torch.Tensor) -> None: ...


class HooklessSync:
    """The `GradSync` defaults of a sync with no compression hook and no per-rank state (ZeRO's
    stages, whose only compression is a 16-bit wire, and expert parallelism)."""

    applies_momentum = False
    replicated = False  # shards (ZeRO) or expert gradients: the norm sums over dp
    kind = "this gradient sync"  # named in the error below

    def optimizer_for(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer  # no compression hook: the optimizer stays as it is

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # nothing per rank beyond the optimizer's shards

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """No per-rank state, and the tensors a checkpoint reads (ZeRO-3's shards) change only in
        the optimizer step, whose own hook runs first: nothing to call."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{self.kind} keeps no per-rank state; got {sorted(state)}")


def accumulate(model: nn.Module, micro_batches: list, grad_sync: GradSync, global_tokens: float | torch.Tensor,
               meter: SavedTensorMeter | None = None, loss_scale: float | torch.Tensor = 1.0,
               before: Callable[[Any], None] | None = None) -> torch.Tensor:
    """Forward and backward over the micro-batches; returns this rank's summed token loss.

    Each micro-batch's backward starts from `summed loss / global_tokens * loss_scale` (fp16's
    dynamic loss scale, a device tensor; the optimizer divides the gradients by it again).
    `before(mb)` runs before each micro-batch's forward (packed rows: its document ids and positions).
    """
    scaled = isinstance(loss_scale, torch.Tensor) or loss_scale != 1.0
    total = None
    for i, mb in enumerate(micro_batches):
        if before is not None:
            before(mb)
        with grad_sync.micro_batch(last=i == len(micro_batches) - 1):
            if meter is not None:
                meter.reset()
                with meter.measure():
                    loss_sum = model(mb.inputs, mb.targets)
            else:
                loss_sum = model(mb.inputs, mb.targets)
            loss = loss_sum / global_tokens
            (loss * loss_scale if scaled else loss).backward()
        loss_sum = loss_sum.detach().float()
        total = loss_sum if total is None else total + loss_sum
    return total


@dataclass(frozen=True)
class Scratch:
    """parallel.offload=nvme (parallel/nvme.py): where the masters and moments stream from, and under ZeRO-3
    the parameter shards' scratch file and (without a pipeline) the reduced gradients' (shard_store.py)."""

    settings: ScratchSettings
    shard_home: ShardStore | None = None
    grad_home: ShardStore | None = None


@dataclass
class ParallelModel:
    module: nn.Module  # this rank's part of the model
    grad_sync: GradSync  # gradient communication over dp
    placements: dict[str, Placement]  # local parameter name -> where it sits in the global model
    pieces: list[Piece] = field(default_factory=list)  # what this rank's optimizer updates
    precision: MixedPrecision | None = None
    zero: int = 0
    offload: bool = False
    after_step: Callable[[], None] | None = None  # e.g. ZeRO-1/2's all-gather of the updated shards
    remat_regions: list[str] = field(default_factory=list)
    pipeline: object | None = None  # pipeline.PipelineRuntime when pp > 1: runs forward_backward
    spec: object | None = None  # the models.spec.ModelSpec it was built from
    materialised_bytes: int = 0  # model-tensor bytes this rank allocated while starting (meta build)
    periodic: Periodic | None = None  # local SGD / DiLoCo / EASGD (train.sync_every...): when replicas meet
    routers: bool = False  # the model (any stage of it) has mixture-of-experts routers
    settle_weights: Callable[[], None] | None = None  # ZeRO-1/2: wait for that all-gather (it overlaps the forward)
    # run once the gradient sync has finished (a lossy dp wire under pp: the tied weights' gradient sum)
    after_sync: Callable[[], None] | None = None
    activation_offload: ActivationOffload | None = None  # remat.offload=cpu: the host copies of saved activations
    scratch: Scratch | None = None  # parallel.offload=nvme: where the states (and ZeRO-3's shards) stream from
    replica_axis: str = "dp"  # the axis gradients are summed over (Mesh.replica_axis: dp, or dp+cp)
    lora_base: object | None = None  # LoRA (parallel/lora.py LoraBase): the frozen base a checkpoint refers to
    documents: Documents | None = None  # packed rows (data.pack): takes each micro-batch's document ids and positions
    comm: object | None = None  # the run's Comm: an optimizer that sees whole matrices exchanges its pieces over it
    _meter: SavedTensorMeter | None = None

    def settle(self) -> None:
        """Make the parameters whole before reading them outside a forward (checkpoints, replica
        checks, a reader after the run): ZeRO-1/2's parameter all-gathers overlap the next forward,
        and with parallel.offload=nvme ZeRO-3's shards are in their scratch file (read in here, all
        of them, until the next pass)."""
        self.complete()
        if self.scratch is not None and self.scratch.shard_home is not None:
            self.scratch.shard_home.settle()

    def complete(self) -> None:
        """The last step's communication complete, the parameters left where they live (the end of a run:
        under ZeRO-3 with parallel.offload=nvme the shards stay in the file; `settle()` reads them in)."""
        if self.settle_weights is not None:
            self.settle_weights()

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def scaler(self):
        return self.precision.scaler if self.precision is not None else None

    # ------------------------------------------------------------ the step

    @property
    def meter(self) -> SavedTensorMeter:
        """Activation bytes autograd saves (the pipeline's meter sees the stages in flight)."""
        if self.pipeline is not None:
            return self.pipeline.meter
        if self._meter is None:
            self._meter = SavedTensorMeter(exclude=self.weight_tensors())
        return self._meter

    def forward_backward(self, micro_batches: list, global_tokens: float | torch.Tensor,
                         loss_scale: float | torch.Tensor = 1.0,
                         before: Callable[[Any], None] | None = None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches (gradients accumulate, the sync runs inside);
        returns this rank's summed token loss (0 on pipeline stages without the loss). `before(mb)`:
        run before each micro-batch's forward (not under a pipeline: config/checks.py refuses data.pack there)."""
        if self.pipeline is not None:
            if before is not None:
                raise ValueError("a pipeline schedule runs its micro-batches' forwards itself: no `before`")
            # dividing the token count by the loss scale (a power of two: exact) scales the loss
            # the schedule backpropagates, as plain accumulation does
            return self.pipeline.forward_backward(micro_batches, global_tokens / loss_scale)
        return accumulate(self.module, micro_batches, self.grad_sync, global_tokens, self.meter, loss_scale, before)

    def make_optimizer(self, cfg: TrainConfig, compression: bool = True) -> ShardedOptimizer | NvmeOptimizer:
        """`cfg.optimizer` with fp32 masters over this rank's pieces (consumes the fp32 initial values);
        1-bit Adam in its place when the gradient compression asks for it (`compression`).

        A gradient hook that applies the momentum itself before the exchange (DGC's momentum
        correction) gets SGD without momentum: the exchanged sum already is the momentum update.
        """
        if cfg.optimizer == "sgd" and self.grad_sync.applies_momentum:
            cfg = replace(cfg, momentum=0.0, nesterov=False)
        fp32_init = self.precision.fp32_init if self.precision is not None else {}
        if self.scratch is not None:  # masters and moments in a scratch file (config/checks.py refuses the rest)
            s = self.scratch
            optimizer = NvmeOptimizer(self.pieces, cfg, s.settings, fp32_init, self.after_step, s.shard_home,
                                      s.grad_home)
        elif self.periodic is not None:  # the replica's own optimizer, then the sync when a period ends
            optimizer = self.periodic.make_optimizer(self.pieces, cfg, fp32_init, self.offload, self.after_step)
        else:
            optimizer = ShardedOptimizer(self.pieces, cfg, fp32_init, self.offload, self.after_step, comm=self.comm)
        fp32_init.clear()  # the masters hold what is needed; free the whole fp32 copy
        for piece in self.pieces:  # and the fp32 chunks of a unit-by-unit ZeRO-3 build
            piece.initial = None
        if self.scratch is not None:
            return optimizer
        if compression:
            optimizer.inner = self.grad_sync.optimizer_for(optimizer.inner)
        return optimizer

    # ------------------------------------------------------------ checkpoint state

    def checkpoint_tensors(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Placement]]:
        """The named tensors a checkpoint holds and their placements: the parameters (a user's module
        adds its persistent buffers, parallel/module.py); with LoRA the adapters only (the frozen base
        is the one `lora_base` names)."""
        if self.lora_base is not None:
            return self.named_trainable(), self.placements
        state = [(n, b) for n, b in self.module.named_buffers() if is_state_buffer(n)]
        if not state:
            return list(self.module.named_parameters()), self.placements
        # equal on every rank that holds the block (models/spec.py STATE_BUFFERS): whole, written by coordinate 0
        places = {n: Placement.whole(n, tuple(b.shape)).replicated("dp", "cp", "tp") for n, b in state}
        return list(self.module.named_parameters()) + state, {**self.placements, **places}

    @property
    def stateful(self) -> dict[str, object]:
        """State outside parameters and optimizer that checkpoints carry (objects with state_dict())."""
        out = {"loss_scaler": self.scaler} if self.scaler is not None else {}
        if self.lora_base is not None:
            out["lora_base"] = self.lora_base
        return out

    @property
    def rank_state(self) -> GradSync | Periodic:
        """This rank's own tensors (gradient-compression residuals, or a periodic run's replica masters and
        moments): restored under the same layout only."""
        return self.periodic if self.periodic is not None else self.grad_sync

    @property
    def norm_axis(self) -> str | None:
        """The axis that stands for the replica axes in the gradient norm: theirs (dp, dp+cp), or a
        replica's own axis between syncs."""
        return self.periodic.norm_axis if self.periodic is not None else self.replica_axis

    # ------------------------------------------------------------ memory accounting

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.grad_sync.gradient_tensors()

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding weights (excluded from activation accounting)."""
        return list(self.module.parameters()) + list(self.module.buffers()) + self.grad_sync.weight_tensors()
