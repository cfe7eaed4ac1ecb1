"""The math of one optimizer step, independent of the layout.

loss = (sum over every token of the global batch of -log p) / (tokens in the global batch).
Each rank runs its micro-batches, dividing each micro-batch's summed loss by the *global*
token count before backward, so the gradients summed by the gradient sync are exactly the
gradient of that mean. Then: global gradient norm, clipping, learning rate, optimizer update.

No host synchronisation: the norm, the overflow flag, the loss scale and the loss stay on the
device; one flag decides skip or step inside the optimizer's kernel (parallel/master.py), and
the trainer reads the step's figures once, after the step is issued (`StepResult.read`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from ..config import TrainConfig
from ..data import Batch
from ..parallel import GradSync, ParallelModel, accumulate  # noqa: F401  (accumulate, GradSync: re-exported)
from ..parallel.master import ShardedOptimizer
from ..sharding import Placement
from .optim import lr_at, set_lr


@dataclass
class StepResult:
    """A step's figures as 0-dim device tensors (reading them waits for the step)."""

    loss_sum: torch.Tensor  # this rank's summed token loss (fp32)
    grad_norm: torch.Tensor  # the global gradient norm (fp32; inf or nan after an overflow)
    lr: float
    skipped: torch.Tensor  # bool: the update was skipped (non-finite gradients)
    loss_scale: torch.Tensor | float = 1.0  # the loss scale this step used (fp16)

    def read(self, *extra: torch.Tensor) -> list[float]:
        """One transfer to the host: [grad_norm, skipped, loss_scale, *extra] as numbers."""
        device = self.grad_norm.device
        values = [self.grad_norm, self.skipped, torch.as_tensor(self.loss_scale, device=device), *extra]
        return torch.stack([v.to(device, torch.float64) for v in values]).tolist()


def global_grad_norm(params: list[nn.Parameter], placements: list[Placement], comm: Comm,
                     dp_axis: str | None = "dp", replicated: bool = False) -> torch.Tensor:
    """sqrt of the sum of squares of every distinct gradient element of the global model.

    Each rank adds the gradients it owns - a copy replicated over an axis counts only at that
    axis's coordinate 0 - and the partial sums are added over every mesh axis, so shards,
    stages and replicas of any layout give the single-device norm. `dp_axis` stands for dp:
    between the syncs of local SGD a replica's own norm is over its inner axis (or none).

    `replicated`: the gradient sync left bitwise the same whole gradients on every dp rank (a
    dense sum). Then every rank adds them all itself and nothing is summed over dp - one
    collective less per step, as DDP's replicas clip locally - with the value the sum over dp
    gives (coordinate 0's partial sum plus zeros).
    """
    mesh = comm.mesh
    local_dp = dp_axis == "dp" and replicated and all("dp" in place.replicated_over for place in placements)

    def owns(axis: str) -> bool:
        if axis == "dp":
            return dp_axis is None or local_dp or mesh.rank(dp_axis) == 0
        return mesh.rank(axis) == 0

    owned = [p.grad for p, place in zip(params, placements)
             if p.grad is not None and all(owns(axis) for axis in place.replicated_over)]
    # on the mesh's device: the collective needs it (offloaded master gradients live on the host)
    sumsq = torch.zeros((), dtype=torch.float32, device=mesh.device)
    if owned:
        sumsq += torch.nn.utils.get_total_norm(owned, foreach=True).float().square().to(mesh.device)
    for axis in ("tp", "pp", None if local_dp else dp_axis):
        if axis is not None:
            comm.all_reduce(sumsq, axis, tag="grad_norm")
    return sumsq.sqrt()


def clip_gradients(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)


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

    def __call__(self, step: int, micro_batches: list[Batch], global_tokens: int) -> StepResult:
        """Run optimizer step `step` (1-based)."""
        # fp16: the scaler's device tensor, copied (the update below changes it in place)
        scale = self.scaler.scale_tensor.clone() if self.scaler is not None else 1.0
        if self.parallel.periodic is not None:  # local SGD: whether this step sums gradients over dp
            self.parallel.periodic.begin_step(step)
        self.grad_sync.zero_grad()
        loss_sum = self.parallel.forward_backward(micro_batches, global_tokens, scale)
        self.grad_sync.finish()
        params, placements = self.optimizer.prepare_grads(1.0 / scale)
        norm = global_grad_norm(params, placements, self.comm, self.parallel.norm_axis, self.grad_sync.replicated)
        # the norm is summed over every mesh axis: every rank sees the same value, hence the same decision
        found_inf = ~torch.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        clip_gradients(params, norm, self.cfg.grad_clip)  # non-finite gradients stay non-finite: skipped below
        lr = lr_at(step, self.cfg)
        set_lr(self.optimizer, lr)
        self.optimizer.step(found_inf)  # the update is skipped on the device where found_inf is set
        return StepResult(loss_sum, norm, lr, found_inf, scale)
