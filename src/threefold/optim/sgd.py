"""SGD with optional (Nesterov) momentum; weight decay as L2 on the gradient (torch's SGD)."""

from __future__ import annotations

from ..config import TrainConfig
from .adamw import kernel
from .entry import Made, OptimizerEntry

KINDS = ("momentum_buffer",)


def states(cfg: TrainConfig, matrix: bool = True) -> tuple[str, ...]:
    return KINDS if cfg.momentum else ()


def make(groups: list[dict], cfg: TrainConfig, fused: bool, matrices=None) -> Made:
    import torch

    inner = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernel(fused))
    kinds = states(cfg)
    return Made(inner, lambda master: kinds)


ENTRY = OptimizerEntry("sgd", make, states,
                       summary="momentum SGD (train.momentum, train.nesterov; what DGC and 1-bit gradients were made for)")
