"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; never biases or norm gains (1-D tensors)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(named_params, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor loop gives the same bits whatever the tensors' grouping,
    # so a sharded optimizer reproduces the unsharded one exactly.
    return torch.optim.AdamW(param_groups(named_params, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 1-based `step`: linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
