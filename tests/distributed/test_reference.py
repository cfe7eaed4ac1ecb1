"""threefold against an independent reference: a plain PyTorch training loop written out here.

The reference shares only the model definition (its initialised weights) and the token
batches with threefold; the loss (`F.cross_entropy` on the logits), the parameter groups,
`torch.optim.AdamW`, `clip_grad_norm_` and the warm-up + cosine learning rate are written
out below. A mistake in threefold's shared step math (the token mean, the norm, clipping,
the schedule, weight decay, the optimizer) therefore shows here, where a comparison of
threefold with itself would not.

fp16: with momentum-free SGD and no clipping the step is proportional to the gradient, so
gradients that reach the optimizer still multiplied by the loss scale (or divided twice)
change every step by that factor; the reported gradient norms are checked too.
"""

import math

import torch
import torch.nn.functional as F

from tests.composition_tasks import train_many
from tests.helpers import make_config, rel_err
from tests.zero_tasks import assemble
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model

STEPS = 20
ADAMW = ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=16", f"train.steps={STEPS}",
         "train.lr=2e-3", "train.warmup_steps=5", "train.min_lr_ratio=0.1", "train.weight_decay=0.1",
         "train.eps=1e-6", "train.grad_clip=0.5", "train.microbatches=2", "run.progress=false", "run.plot=false"]
SGD = ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=16", "train.steps=6",
       "train.optimizer=sgd", "train.lr=0.5", "train.momentum=0", "train.weight_decay=0", "train.grad_clip=0",
       "train.min_lr_ratio=1.0", "train.microbatches=2", "run.progress=false", "run.plot=false"]
TOL = 1e-5


def lr_at(step: int, lr: float, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr down to min_ratio * lr at `steps`."""
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / (steps - warmup)
    return lr * min_ratio + lr * (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def reference_run(overrides: list[str]) -> dict:
    """Plain PyTorch: one process, the whole global batch per step, the loss mean over its tokens."""
    cfg = make_config(overrides, "unused")
    t = cfg.train
    torch.manual_seed(0)
    model = build_model(cfg.model, t.seed)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    params = list(model.parameters())  # the tied embedding / head weight once
    if t.optimizer == "adamw":
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    else:
        optimizer = torch.optim.SGD(params, lr=t.lr)
    losses, norms = [], []
    for step in range(1, t.steps + 1):
        batch = sampler.step_batch(step - 1)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
        loss = loss / batch.targets.numel()
        optimizer.zero_grad()
        loss.backward()
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def errors(results: list[dict], ref: dict) -> tuple[float, float, tuple[float, str]]:
    """Largest relative error of the losses, the gradient norms and any global parameter."""
    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    norm = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["norms"], ref["norms"], strict=True))
    got = assemble([r["params"] for r in results], [r["placements"] for r in results])
    assert got.keys() == ref["params"].keys()
    return loss, norm, max((rel_err(got[k], v), k) for k, v in ref["params"].items())


def test_threefold_matches_a_plain_pytorch_loop(worlds, tmp_path, capsys):
    ref = reference_run(ADAMW)
    assert max(ref["norms"]) > 0.5, "clipping never active: the test would not cover it"
    assert ref["losses"][-1] < ref["losses"][0] - 0.01, "it did not train"
    single = worlds(1).run(train_many, [(ADAMW, str(tmp_path / "single"))])[0][0]
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1", "pipeline.schedule=1f1b"]
    sharded = [r[0] for r in worlds(8).run(train_many, [(ADAMW + layout, str(tmp_path / "zero1"))])]
    lines = []
    for name, results in (("one process", [single]), ("(2,2,2) ZeRO-1", sharded)):
        loss, norm, (param, worst) = errors(results, ref)
        lines.append(f"{name}: loss {loss:.1e} grad norm {norm:.1e} params {param:.1e} ({worst})")
        assert loss <= TOL and norm <= TOL and param <= TOL, lines[-1]
    with capsys.disabled():
        print(f"\nagainst the plain PyTorch loop, {STEPS} steps:\n  " + "\n  ".join(lines))


def test_fp16_gradients_reach_the_optimizer_unscaled(worlds, tmp_path, capsys):
    """The fp16 runs (loss scale 2^16) take the fp32 reference's SGD steps to fp16 rounding."""
    ref = reference_run(SGD)
    fp16 = SGD + ["precision.compute=fp16"]
    single = worlds(1).run(train_many, [(fp16, str(tmp_path / "single"))])[0][0]
    layout = ["parallel.dp=2", "parallel.pp=2", "pipeline.schedule=1f1b", "parallel.zero=1"]
    piped = [r[0] for r in worlds(4).run(train_many, [(fp16 + layout, str(tmp_path / "pp"))])]
    lines = []
    for name, results in (("one process", [single]), ("(2,1,2) ZeRO-1 1f1b", piped)):
        loss, norm, (param, worst) = errors(results, ref)
        lines.append(f"{name}: loss {loss:.1e} grad norm {norm:.1e} params {param:.1e} ({worst})")
        # fp16 keeps ~3 decimal digits; a loss-scale factor 2^16 left in (or applied twice) is 5 orders off
        assert loss <= 1e-2 and norm <= 1e-2 and param <= 5e-2, lines[-1]
    with capsys.disabled():
        print("\nfp16 SGD against the fp32 plain PyTorch loop:\n  " + "\n  ".join(lines))
