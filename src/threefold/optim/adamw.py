"""AdamW (decoupled weight decay): torch's multi-tensor kernels, fused on CUDA (parallel/master.py)."""

from __future__ import annotations

from ..config import TrainConfig
from .entry import Made, OptimizerEntry

KINDS = ("exp_avg", "exp_avg_sq")


def kernel(fused: bool) -> dict:
    """Fused where the masters are on CUDA (one kernel, step counts and the skip flag on the device); foreach elsewhere (its bits
    are the single-tensor loop's whatever the grouping: torch's CPU fused kernels round a tail differently)."""
    return {"foreach": None, "fused": True} if fused else {"foreach": True}


def make(groups: list[dict], cfg: TrainConfig, fused: bool, matrices=None) -> Made:
    import torch

    inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel(fused))
    return Made(inner, lambda master: KINDS)


def streamed(params: list, grads: list, states: list[list], step: int, group: dict, cfg: TrainConfig) -> None:
    """torch's multi-tensor AdamW over views of the masters and moments (parallel/nvme.py streams them)."""
    import torch
    from torch.optim.adam import adam

    steps = [torch.tensor(float(step)) for _ in params]  # each piece's count (incremented by the kernel)
    adam(params, grads, states[0], states[1], [], steps, foreach=True, decoupled_weight_decay=True, amsgrad=False,
         beta1=cfg.beta1, beta2=cfg.beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=cfg.eps,
         maximize=False)


ENTRY = OptimizerEntry("adamw", make, lambda cfg, matrix: KINDS, streamed=streamed,
                       summary="AdamW, decoupled weight decay on matrices and embeddings (exp_avg, exp_avg_sq)")
