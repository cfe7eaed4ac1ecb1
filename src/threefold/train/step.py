"""The math of one optimizer step, independent of the layout.

loss = (sum over every token of the global batch of -log p) / (tokens in the global batch).
Each rank runs its micro-batches, dividing each micro-batch's summed loss by the *global*
token count before backward, so the gradients summed by the gradient sync are exactly the
gradient of that mean. Then: global gradient norm, clipping, learning rate, optimizer update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from ..comm import Comm
from ..config import TrainConfig
from ..data import Batch
from ..observe.memory import SavedTensorMeter
from ..sharding import Placement
from .optim import lr_at, set_lr


class GradSync(Protocol):
    """Gradient communication over dp: the data-parallel reducer or a ZeRO stage."""

    def micro_batch(self, last: bool): ...  # context manager around one micro-batch's backward
    def finish(self) -> None: ...
    def zero_grad(self) -> None: ...


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed token loss (0-dim, fp32)
    grad_norm: float
    lr: float
    skipped: bool = False


def global_grad_norm(params: list[nn.Parameter], placements: list[Placement], comm: Comm) -> torch.Tensor:
    """sqrt of the sum of squares of every distinct gradient element of the global model.

    Each rank adds the gradients it owns - a copy replicated over an axis counts only at that
    axis's coordinate 0 - and the partial sums are added over every mesh axis, so shards,
    stages and replicas of any layout give the single-device norm.
    """
    mesh = comm.mesh
    owned = [p.grad for p, place in zip(params, placements)
             if p.grad is not None and all(mesh.rank(axis) == 0 for axis in place.replicated_over)]
    # on the mesh's device: the collective needs it (offloaded master gradients live on the host)
    sumsq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    if owned:
        sumsq += torch.nn.utils.get_total_norm(owned, foreach=True).float().square().to(mesh.device)
    for axis in ("tp", "pp", "dp"):
        comm.all_reduce(sumsq, axis, tag="grad_norm")
    return sumsq.sqrt()


def clip_gradients(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


def accumulate(model: nn.Module, micro_batches: list[Batch], grad_sync: GradSync, global_tokens: int,
               meter: SavedTensorMeter | None = None, loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward over the micro-batches; returns this rank's summed token loss.

    `loss_scale` (fp16's dynamic loss scale) multiplies what backward starts from; the optimizer
    divides the gradients by it again.
    """
    total = None
    for i, mb in enumerate(micro_batches):
        with grad_sync.micro_batch(last=i == len(micro_batches) - 1):
            if meter is not None:
                meter.reset()
                with meter.measure():
                    loss_sum = model(mb.inputs, mb.targets)
            else:
                loss_sum = model(mb.inputs, mb.targets)
            loss = loss_sum / global_tokens
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        loss_sum = loss_sum.detach().float()
        total = loss_sum if total is None else total + loss_sum
    return total


class TrainStep:
    """forward/backward -> gradient sync -> norm and clip -> optimizer step, for one step.

    With threefold's optimizer (parallel/master.py: fp32 masters, shards, offload) the norm and
    the clipping act on the fp32 master gradients of the pieces this rank owns, after dividing
    by the loss scale; a plain torch optimizer acts on `params` as they are.
    A custom `forward_backward` must multiply the loss it backpropagates by `self.loss_scale`.
    """

    def __init__(self, model: nn.Module, grad_sync: GradSync, optimizer, comm: Comm,
                 cfg: TrainConfig, params: list[nn.Parameter], placements: list[Placement],
                 forward_backward: Callable | None = None, scaler=None, weights: list[torch.Tensor] | None = None,
                 meter: SavedTensorMeter | None = None):
        self.model = model
        self.grad_sync = grad_sync
        self.optimizer = optimizer
        self.comm = comm
        self.cfg = cfg
        self.params = params
        self.placements = placements
        self.scaler = scaler  # parallel/precision.py DynamicLossScaler (fp16) or None
        self.loss_scale = 1.0
        if weights is None:
            weights = list(model.parameters()) + list(model.buffers())
        # forward_backward: a schedule's runtime (pipeline) instead of plain accumulation; it
        # then brings the meter that sees its activations
        self.meter = meter or SavedTensorMeter(exclude=weights)
        self.forward_backward = forward_backward or (
            lambda mbs, tokens: accumulate(model, mbs, grad_sync, tokens, self.meter, self.loss_scale))

    def __call__(self, step: int, micro_batches: list[Batch], global_tokens: int) -> StepResult:
        """Run optimizer step `step` (1-based)."""
        self.loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        self.grad_sync.zero_grad()
        loss_sum = self.forward_backward(micro_batches, global_tokens)
        self.grad_sync.finish()
        prepare = getattr(self.optimizer, "prepare_grads", None)
        params, placements = (prepare(1.0 / self.loss_scale) if prepare is not None
                              else (self.params, self.placements))
        norm = global_grad_norm(params, placements, self.comm)
        # the norm is summed over every mesh axis: every rank sees the same value, hence the same decision
        finite = math.isfinite(float(norm))
        if self.scaler is not None:
            self.scaler.update(found_inf=not finite)
        if not finite:
            if hasattr(self.optimizer, "skip"):
                self.optimizer.skip()
            return StepResult(loss_sum, float(norm), lr_at(step, self.cfg), skipped=True)
        clip_gradients(params, norm, self.cfg.grad_clip)
        lr = lr_at(step, self.cfg)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        return StepResult(loss_sum, float(norm), lr)
