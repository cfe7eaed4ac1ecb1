"""The math of one optimizer step, independent of the layout.

loss = (sum over every token of the global batch of -log p) / (tokens in the global batch).
Each rank runs its micro-batches, dividing each micro-batch's summed loss by the *global*
token count before backward, so the gradients summed by the gradient sync are exactly the
gradient of that mean. Then: global gradient norm, clipping, learning rate, optimizer update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from ..config import TrainConfig
from ..data import Batch
from ..parallel import GradSync, ParallelModel, accumulate  # noqa: F401  (accumulate, GradSync: re-exported)
from ..sharding import Placement
from .optim import lr_at, set_lr


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed token loss (0-dim, fp32)
    grad_norm: float
    lr: float
    skipped: bool = False


def global_grad_norm(params: list[nn.Parameter], placements: list[Placement], comm: Comm,
                     dp_axis: str | None = "dp") -> torch.Tensor:
    """sqrt of the sum of squares of every distinct gradient element of the global model.

    Each rank adds the gradients it owns - a copy replicated over an axis counts only at that
    axis's coordinate 0 - and the partial sums are added over every mesh axis, so shards,
    stages and replicas of any layout give the single-device norm. `dp_axis` stands for dp:
    between the syncs of local SGD a replica's own norm is over its inner axis (or none).
    """
    mesh = comm.mesh

    def owns(axis: str) -> bool:
        if axis == "dp":
            return dp_axis is None or mesh.rank(dp_axis) == 0
        return mesh.rank(axis) == 0

    owned = [p.grad for p, place in zip(params, placements)
             if p.grad is not None and all(owns(axis) for axis in place.replicated_over)]
    # on the mesh's device: the collective needs it (offloaded master gradients live on the host)
    sumsq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    if owned:
        sumsq += torch.nn.utils.get_total_norm(owned, foreach=True).float().square().to(mesh.device)
    for axis in ("tp", "pp", dp_axis):
        if axis is not None:
            comm.all_reduce(sumsq, axis, tag="grad_norm")
    return sumsq.sqrt()


def clip_gradients(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


class TrainStep:
    """forward/backward -> gradient sync -> norm and clip -> optimizer step, for one step.

    Forward and backward are the parallel model's (`ParallelModel.forward_backward`: plain
    accumulation or the pipeline schedule). With threefold's optimizer (parallel/master.py: fp32
    masters, shards, offload) the norm and the clipping act on the fp32 master gradients of the
    pieces this rank owns, after dividing by the loss scale; a plain torch optimizer acts on the
    parameters as they are.
    """

    def __init__(self, parallel: ParallelModel, optimizer, comm: Comm, cfg: TrainConfig):
        self.parallel = parallel
        self.grad_sync = parallel.grad_sync
        self.optimizer = optimizer
        self.comm = comm
        self.cfg = cfg
        self.params = parallel.params
        self.placements = parallel.param_placements
        self.scaler = parallel.scaler  # parallel/precision.py DynamicLossScaler (fp16) or None
        self.loss_scale = 1.0
        self.meter = parallel.meter

    def __call__(self, step: int, micro_batches: list[Batch], global_tokens: int) -> StepResult:
        """Run optimizer step `step` (1-based)."""
        self.loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.parallel.periodic is not None:  # local SGD: whether this step sums gradients over dp
            self.parallel.periodic.begin_step(step)
        self.grad_sync.zero_grad()
        loss_sum = self.parallel.forward_backward(micro_batches, global_tokens, self.loss_scale)
        self.grad_sync.finish()
        prepare = getattr(self.optimizer, "prepare_grads", None)
        params, placements = (prepare(1.0 / self.loss_scale) if prepare is not None
                              else (self.params, self.placements))
        norm = global_grad_norm(params, placements, self.comm, self.parallel.norm_axis)
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
