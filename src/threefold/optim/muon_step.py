"""Muon's step (optim/muon.py has the rule and the entry): the momentum and the update on the
pieces this rank holds, Newton-Schulz on whole matrices through the exchange (optim/exchange.py)."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from .adamw import KINDS as ADAM_KINDS
from .entry import Matrices

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@torch.no_grad()
def update_scale(shape: tuple[int, ...]) -> float:
    """Moonlight's factor: an orthogonal update of RMS 1/sqrt(max(m, n)) brought to AdamW's ~0.2."""
    return 0.2 * math.sqrt(max(shape))


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The orthogonal factor of `g` (2-D) approximated by `steps` quintic Newton-Schulz iterations, fp32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon:
    """The optimizer over the masters: Muon on the groups marked "matrix", torch's AdamW on the others.

    A torch optimizer's face (param_groups, state, defaults, step) so the learning-rate schedule,
    clipping and checkpoints apply unchanged; the AdamW part shares `state`."""

    def __init__(self, groups: list[dict], cfg: TrainConfig, matrices: Matrices, kinds: tuple[str, ...]):
        self.matrix_groups = [g for g in groups if g.get("matrix")]
        rest = [g for g in groups if not g.get("matrix")] or [{"params": [torch.zeros(0)], "weight_decay": 0.0}]
        # foreach: the same bits whatever the grouping (pieces reproduce whole tensors); see parallel/master.py
        self.adamw = torch.optim.AdamW(rest, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
        for g in self.matrix_groups:
            g.setdefault("lr", cfg.lr)
        self.param_groups = self.matrix_groups + self.adamw.param_groups
        self.state = self.adamw.state
        self.defaults = {"fused": False, "lr": cfg.lr}
        self.found_inf = None
        self.momentum, self.nesterov, self.ns_steps = cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps
        self.matrices, self.matrix_kinds = matrices, kinds  # the registry's state names (optim/muon.py KINDS)

    def kinds(self, master: torch.Tensor) -> tuple[str, ...]:
        return self.matrix_kinds if any(master is p for g in self.matrix_groups for p in g["params"]) else ADAM_KINDS

    @torch.no_grad()
    def step(self) -> None:
        mu, steps = self.momentum, self.ns_steps
        params, updates, lrs, decays = [], [], [], []
        for group in self.matrix_groups:
            for p in group["params"]:
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                updates.append(p.grad.lerp(buf, mu) if self.nesterov else buf.clone())
                params.append(p)
                lrs.append(group["lr"])
                decays.append(group["weight_decay"])
        # every rank calls this, also one without a matrix piece: the exchange is collective
        ortho = self.matrices.orthogonalise(updates, lambda g: newton_schulz(g, steps).mul_(update_scale(g.shape)))
        for p, o, lr, wd in zip(params, ortho, lrs, decays):
            p.mul_(1 - lr * wd).add_(o, alpha=-lr)
        self.adamw.step()
