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


def streamed(params: list, grads: list, states: list[list], step: int, group: dict, cfg: TrainConfig) -> None:
    """torch's multi-tensor SGD over views of the masters and momenta (parallel/nvme.py streams them)."""
    from torch.optim.sgd import sgd

    sgd(params, grads, states[0] if states else [None] * len(params), foreach=True,
        weight_decay=group["weight_decay"], momentum=cfg.momentum, lr=group["lr"], dampening=0.0,
        nesterov=cfg.nesterov, maximize=False)


ENTRY = OptimizerEntry("sgd", make, states, streamed=streamed,
                       summary="momentum SGD (train.momentum, train.nesterov; what DGC and 1-bit gradients were made for)")
