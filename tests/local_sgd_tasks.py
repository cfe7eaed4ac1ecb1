"""Local SGD / DiLoCo / EASGD: an independent plain PyTorch loop of each algorithm, and the world tasks
of tests/distributed/test_local_sgd.py (module level: picklable)."""

from __future__ import annotations

import contextlib
import copy
import io
import os

import torch
import torch.nn.functional as F

from tests.helpers import make_config
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model


def _lr(step: int, t) -> float:
    import math

    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.lr * t.min_lr_ratio + t.lr * (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def reference_run(overrides: list[str], replicas: int, resume_at: int = 0, resumed_replicas: int = 0) -> dict:
    """`replicas` copies of the model, each with its own AdamW on its slice of the global batch;
    every-step gradient averaging during train.sync_warmup_steps, then the outer algorithm every H steps.
    With `resume_at`: after that step, `resumed_replicas` replicas go on, each a copy of replica 0 (its
    parameters and AdamW state), the outer state kept: a resume under another dp."""
    cfg = make_config(overrides, "unused")
    t = cfg.train
    base = build_model(cfg.model, t.seed)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    models = [copy.deepcopy(base) for _ in range(replicas)]
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    outer = centre = outer_opt = None

    def make_optimizer(ps: list) -> torch.optim.AdamW:
        return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": t.weight_decay},
                                  {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)

    def start_outer():
        nonlocal outer, centre, outer_opt
        outer = [p.detach().clone() for p in params[0]]
        centre = [p.detach().clone() for p in params[0]]
        outer_opt = torch.optim.SGD(outer, lr=t.outer_lr, momentum=t.outer_momentum, nesterov=True)

    optims = [make_optimizer(ps) for ps in params]
    start_outer()
    losses, norms = [], []
    for step in range(1, t.steps + 1):
        if step == resume_at + 1 and resume_at:  # every new replica starts from replica 0
            state = optims[0].state_dict()
            replicas = resumed_replicas
            models = [copy.deepcopy(models[0]) for _ in range(replicas)]
            params = [[p for p in m.parameters() if p.requires_grad] for m in models]
            optims = [make_optimizer(ps) for ps in params]
            for optim in optims:
                optim.load_state_dict(copy.deepcopy(state))  # each its own moments
        step_losses = []
        for r, model in enumerate(models):
            batch = sampler.step_batch(step - 1, r, replicas)
            logits = model(batch.inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
            optims[r].zero_grad()
            loss.backward()
            step_losses.append(float(loss.detach()))
        if step <= t.sync_warmup_steps:  # synchronous: every replica takes the mean gradient
            for group in zip(*params):
                mean = torch.stack([p.grad for p in group]).mean(0)
                for p in group:
                    p.grad = mean.clone()
        for r in range(replicas):
            norm = torch.nn.utils.clip_grad_norm_(params[r], t.grad_clip)
            if r == 0:
                norms.append(float(norm))
            for g in optims[r].param_groups:
                g["lr"] = _lr(step, t)
            optims[r].step()
        losses.append(sum(step_losses) / replicas)
        if step == t.sync_warmup_steps:
            start_outer()
        elif step > t.sync_warmup_steps and (step - t.sync_warmup_steps) % t.sync_every == 0:
            _meet(t, params, optims, outer, centre, outer_opt)
    return {"losses": losses, "norms": norms,
            "params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]}


@torch.no_grad()
def _meet(t, params, optims, outer, centre, outer_opt) -> None:
    for i, group in enumerate(zip(*params)):
        mean = torch.stack([p for p in group]).mean(0)
        if t.easgd_alpha > 0:
            pull = [t.easgd_alpha * (p - centre[i]) for p in group]
            for p, d in zip(group, pull):
                p.sub_(d)
            centre[i].add_(sum(pull))
        elif t.outer_optimizer == "nesterov":
            outer[i].grad = outer[i] - mean
        else:
            for p in group:
                p.copy_(mean)
    if t.outer_optimizer == "nesterov":
        outer_opt.step()
        for i, group in enumerate(zip(*params)):
            for p in group:
                p.copy_(outer[i])
    if t.sync_optimizer_state:
        for group in zip(*params):
            for kind in ("exp_avg", "exp_avg_sq"):
                states = [optims[r].state[p][kind] for r, p in enumerate(group)]
                mean = torch.stack(states).mean(0)
                for s in states:
                    s.copy_(mean)


def _hpz_peak(trainer) -> int:
    """Elements of the hpZ node-local copy at its largest (0 without hpZ)."""
    from threefold.parallel.hpz import SecondaryPartition
    from threefold.parallel.zero3 import Zero3

    sync = trainer.parallel.grad_sync
    return sync.hpz.peak_numel if isinstance(sync, Zero3) and isinstance(sync.hpz, SecondaryPartition) else 0


def train_runs(runs: list[tuple[list[str], str]], local_world_size: int = 0) -> list[dict]:
    """Train each (overrides, out); with `local_world_size` the launcher's nodes are that many processes."""
    from threefold.train.trainer import Trainer

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world_size:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    out = []
    try:
        for overrides, run_dir in runs:
            with contextlib.redirect_stderr(io.StringIO()):
                trainer = Trainer(make_config(overrides, run_dir))
                records = trainer.run()
            out.append({"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                        "comm": [r["comm"] for r in records], "rank": trainer.mesh.global_rank,
                        "replica": trainer.mesh.rank("dp_inter" if trainer.mesh.has_node_axes() else "dp"),
                        "leader": not trainer.mesh.has_node_axes() or trainer.mesh.rank("dp_intra") == 0,
                        "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()},
                        "placements": dict(trainer.parallel.placements), "hpz_peak": _hpz_peak(trainer)})
    finally:
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return out
