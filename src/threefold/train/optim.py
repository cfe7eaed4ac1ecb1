"""The learning-rate schedule (warm-up + cosine) and its setter; the optimizers are optim/registry.py's."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig


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
