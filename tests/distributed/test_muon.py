"""Muon (train.optimizer=muon) against a plain single-process Muon written out here, under
(dp, tp, pp) layouts and ZeRO stages, and the bytes its whole-matrix exchange moves.

The reference shares only the model definition (its initial weights) and the token batches
with threefold: the loss, the clipping, the learning-rate schedule, the momentum, the
Newton-Schulz iteration, Moonlight's update scale and the AdamW for the other parameters are
written below from the papers (Jordan et al. 2024, Liu et al. 2025), not taken from threefold.

ParallelModel.make_optimizer does not hand the optimizer the run's Comm yet (a two-line change
in parallel/model.py and parallel/__init__.py); `seam` below stands in for it in the test
world, so the exchange runs on the trainer's own Comm and its bytes land in the step records.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from tests.helpers import make_config, rel_err
from tests.zero_tasks import assemble

STEPS = 6
BASE = ["model.preset=tiny", "model.layers=2", "train.global_batch=8", "train.seq_len=16", f"train.steps={STEPS}",
        "train.optimizer=muon", "train.lr=2e-2", "train.warmup_steps=2", "train.min_lr_ratio=0.1",
        "train.weight_decay=0.1", "train.eps=1e-6", "train.grad_clip=0.5", "train.microbatches=2",
        "run.progress=false", "run.plot=false"]
TOL = 1e-5


def lr_at(step: int, lr: float, warmup: int, steps: int, min_ratio: float) -> float:
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / (steps - warmup)
    return lr * min_ratio + lr * (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def orthogonalise(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration (fp32 here)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.size(0) > g.size(1) else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.T if g.size(0) > g.size(1) else x


def reference_run(overrides: list[str]) -> dict:
    """One process, the whole global batch per step; Muon on hidden matrices, AdamW on the rest."""
    from threefold.data import Sampler, load_tokens
    from threefold.models.decoder import build_model

    cfg = make_config(overrides, "unused")
    t = cfg.train
    torch.manual_seed(0)
    model = build_model(cfg.model, t.seed)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.dim() == 2 and not n.startswith("embed")]
    others = [(n, p) for n, p in named if not (p.dim() == 2 and not n.startswith("embed"))]
    adamw = torch.optim.AdamW([{"params": [p for _, p in others if p.dim() >= 2], "weight_decay": t.weight_decay},
                               {"params": [p for _, p in others if p.dim() < 2], "weight_decay": 0.0}],
                              lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    momentum = [torch.zeros_like(p) for p in hidden]
    mu = t.muon_momentum
    params = [p for _, p in named]
    losses, norms = [], []
    for step in range(1, t.steps + 1):
        batch = sampler.step_batch(step - 1)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
        loss = loss / batch.targets.numel()
        adamw.zero_grad()
        for p in hidden:
            p.grad = None
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip)))
        lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        with torch.no_grad():
            for p, m in zip(hidden, momentum):
                m.mul_(mu).add_(p.grad, alpha=1 - mu)
                u = p.grad * (1 - mu) + m * mu
                o = orthogonalise(u, t.muon_ns_steps) * (0.2 * max(p.shape) ** 0.5)
                p.mul_(1 - lr * t.weight_decay).add_(o, alpha=-lr)
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@contextlib.contextmanager
def seam():
    """The run's Comm handed to the optimizer (what parallel/model.py will do), for this test world only."""
    from threefold.parallel.master import ShardedOptimizer
    from threefold.parallel.model import ParallelModel
    from threefold.train import trainer

    made, original_comm, original_make = [], trainer.Comm, ParallelModel.make_optimizer

    class Kept(original_comm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    def make_optimizer(self, cfg, compression=True):
        fp32_init = self.precision.fp32_init if self.precision is not None else {}
        optimizer = ShardedOptimizer(self.pieces, cfg, fp32_init, self.offload, self.after_step, comm=made[-1])
        fp32_init.clear()
        for piece in self.pieces:
            piece.initial = None
        return optimizer

    trainer.Comm, ParallelModel.make_optimizer = Kept, make_optimizer
    try:
        yield
    finally:
        trainer.Comm, ParallelModel.make_optimizer = original_comm, original_make


def train_muon(runs: list[tuple[list[str], str]]) -> list[dict]:
    """Each run on this rank of the world: losses, norms, local parameters, placements, matrix bytes."""
    from threefold.train.trainer import Trainer

    out = []
    for overrides, path in runs:
        with seam():
            trainer = Trainer(make_config(overrides, path))
            records = trainer.run()
        exchange = trainer.optimizer.inner.matrices
        out.append({"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                    "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
                    "placements": dict(trainer.parallel.placements),
                    "bytes": [{axis: ops.get("all_to_all.matrices", 0) for axis, ops in r["comm"].items()}
                              for r in records],
                    "owned": sum(1 for m in exchange.matrices if m.owner == (exchange.d, exchange.t)),
                    "matrices": len(exchange.matrices)})
    return out


def check(results: list[dict], ref: dict, name: str) -> str:
    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    got = assemble([r["params"] for r in results], [r["placements"] for r in results])
    assert got.keys() == ref["params"].keys()
    param, worst = max((rel_err(got[k], v), k) for k, v in ref["params"].items())
    line = f"{name}: loss {loss:.1e} params {param:.1e} ({worst})"
    assert loss <= TOL and param <= TOL, line
    return line


def test_muon_on_one_process_matches_a_plain_muon(worlds, tmp_path):
    ref = reference_run(BASE)
    assert max(ref["norms"]) > 0.5, "clipping never active: the test would not cover it"
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "it did not train"
    single = worlds(1).run(train_muon, [(BASE, str(tmp_path / "single"))])[0][0]
    check([single], ref, "one process")
    assert single["owned"] == single["matrices"] == 12  # 2 blocks x (q, k, v, o, up, down)
