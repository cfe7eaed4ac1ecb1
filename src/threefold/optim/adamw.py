"""AdamW (decoupled weight decay): torch's multi-tensor kernels, fused on CUDA (parallel/master.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import TrainConfig
from .entry import Made, OptimizerEntry

if TYPE_CHECKING:
    import torch

KINDS = ("exp_avg", "exp_avg_sq")


def kernel(device: torch.device) -> dict:
    """Fused on CUDA (one kernel, step counts and the skip flag on the device); foreach elsewhere (its bits
    are the single-tensor loop's whatever the grouping: torch's CPU fused kernels round a tail differently)."""
    return {"foreach": None, "fused": True} if device.type == "cuda" else {"foreach": True}


def make(groups: list[dict], cfg: TrainConfig, device: torch.device, matrices=None) -> Made:
    import torch

    inner = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel(device))
    return Made(inner, lambda master: KINDS)


ENTRY = OptimizerEntry("adamw", make, lambda cfg, matrix: KINDS,
                       summary="AdamW, decoupled weight decay on matrices and embeddings (exp_avg, exp_avg_sq)")
