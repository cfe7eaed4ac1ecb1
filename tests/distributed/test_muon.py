"""Muon (train.optimizer=muon) against a plain single-process Muon written out here, under
(dp, tp, pp) layouts and ZeRO stages, and the bytes its whole-matrix exchange moves.

The reference shares only the model definition (its initial weights) and the token batches
with threefold: the loss, the clipping, the learning-rate schedule, the momentum, the
Newton-Schulz iteration, Moonlight's update scale and the AdamW for the other parameters are
written below from the papers (Jordan et al. 2024, Liu et al. 2025), not taken from threefold.

The exchange runs on the trainer's own Comm (ParallelModel.comm), so its bytes land in the step
records.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.helpers import make_config, rel_err
from tests.zero_tasks import assemble

STEPS = 6
BASE = ["model.preset=tiny", "model.layers=2", "train.global_batch=8", "train.seq_len=16", f"train.steps={STEPS}",
        "train.optimizer=muon", "train.lr=1e-2", "train.warmup_steps=2", "train.min_lr_ratio=0.1",
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
        x = a * x + (b * s + c * s @ s) @ x  # as the reference writes it: (c s) @ s
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
                m.lerp_(p.grad, 1 - mu)  # the reference's momentum.lerp_(grad, 1 - beta)
                u = p.grad.lerp(m, mu)  # and its Nesterov grad.lerp_(momentum, beta)
                o = orthogonalise(u, t.muon_ns_steps) * (0.2 * max(p.shape) ** 0.5)
                p.mul_(1 - lr * t.weight_decay).add_(o, alpha=-lr)
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}



def train_muon(runs: list[tuple[list[str], str]]) -> list[dict]:
    """Each run on this rank of the world: losses, norms, local parameters, placements, matrix bytes."""
    from threefold.train.trainer import Trainer

    out = []
    for overrides, path in runs:
        trainer = Trainer(make_config(overrides, path))
        records = trainer.run()
        exchange = trainer.optimizer.inner.matrices
        out.append({"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                    "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
                    "placements": dict(trainer.parallel.placements),
                    "bytes": [{axis: ops.get("all_to_all.matrices", 0) for axis, ops in r["comm"].items()}
                              for r in records],
                    "owned": sum(1 for m in exchange.matrices if m.owner == (exchange.d, exchange.t)),
                    "matrices": len(exchange.matrices), "formula_bytes": formula_bytes(trainer.optimizer.placements, trainer.mesh)})
    return out


def formula_bytes(placements, mesh) -> int:
    """docs/zero.md's formula, bytes a step summed over all ranks, from every rank's optimizer pieces
    (gathered here: ZeRO-1's ranges are where a bucket's cut falls). Per stage, the k-th largest hidden
    matrix (then by name) is owned by grid position k mod dp*tp = (dp coordinate, tp coordinate); per
    matrix, tp: 2 sum of the other tp boxes (the scatter alone when the owner's box is whole); per tp box
    of L elements, dp: 2 (L - h) under ZeRO (h: what the owner's dp coordinate holds), (dp-1) L plain."""
    import torch.distributed as dist

    from threefold.optim.muon import hidden_matrix

    mine = [(p.name, p.global_shape, math.prod(p.shape), p.flat_range) for p in placements
            if hidden_matrix(p.name, p.global_shape)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ((mesh.rank("pp"), mesh.rank("dp"), mesh.rank("tp")), mine))
    dp, tp, total = mesh.size("dp"), mesh.size("tp"), 0
    for stage in range(mesh.size("pp")):
        held = {(d, t): rows for (s, d, t), rows in everyone if s == stage}
        shapes = {name: shape for rows in held.values() for name, shape, _, _ in rows}
        for k, name in enumerate(sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n))):
            owner_d, owner_t = divmod(k % (dp * tp), tp)
            n = math.prod(shapes[name])
            box = {t: next(size for d_ in range(dp) for nm, _, size, _ in held[(d_, t)] if nm == name) for t in range(tp)}
            others = sum(box[t] for t in range(tp) if t != owner_t)
            total += others * (1 if box[owner_t] == n else 2)
            for t in range(tp):
                ranges = {d: r for d in range(dp) for nm, _, _, r in held[(d, t)] if nm == name}
                if all(r is None for r in ranges.values()):
                    total += (dp - 1) * box[t]
                else:
                    r = ranges.get(owner_d)
                    h = 0 if r is None else min(r[1], box[t]) - min(r[0], box[t])
                    total += 2 * (box[t] - h)
    return total * ELT


def check(results: list[dict], ref: dict, name: str) -> str:
    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    got = assemble([r["params"] for r in results], [r["placements"] for r in results])
    assert got.keys() == ref["params"].keys()
    param, worst = max((rel_err(got[k], v), k) for k, v in ref["params"].items())
    line = f"{name}: loss {loss:.1e} params {param:.1e} ({worst})"
    assert loss <= TOL and param <= TOL, line
    return line


def test_muon_on_one_process_matches_a_plain_muon(worlds, tmp_path, capsys):
    ref = reference_run(BASE)
    assert max(ref["norms"]) > 0.5, "clipping never active: the test would not cover it"
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "it did not train"
    single = worlds(1).run(train_muon, [(BASE, str(tmp_path / "single"))])[0][0]
    line = check([single], ref, "one process")
    assert single["owned"] == single["matrices"] == 12  # 2 blocks x (q, k, v, o, up, down)
    assert matrix_bytes([single]) == [0] * STEPS
    with capsys.disabled():
        print(f"\nMuon against the plain single-process Muon, {STEPS} steps: {line}")


HIDDEN = 2 * (4 * 32 * 32 + 2 * 128 * 32)  # elements of the 12 hidden matrices (q, k, v, o, up, down per block)
ELT = 4  # the exchange moves fp32


def matrix_bytes(results: list[dict]) -> list[int]:
    """Bytes the exchange sent per step, summed over ranks and axes."""
    return [sum(sum(step.values()) for step in steps) for steps in zip(*(r["bytes"] for r in results))]


def test_muon_under_dp_zero_and_tp_matches_a_plain_muon_with_the_bytes_of_docs_zero_md(worlds, tmp_path, capsys):
    """dp2 ZeRO-1, dp2 plain, tp2, pp2 and dp2 ZeRO-3 on 2 ranks: the parameters of the plain Muon and the
    bytes of the formula: ZeRO 2 (N - h) (h: the owner's share, N/2 under ZeRO-3), plain dp (dp-1) N, tp 2 N/2,
    pp nothing (each stage's matrices stay on its rank)."""
    ref = reference_run(BASE)
    layouts = {"dp2 ZeRO-1": ["parallel.dp=2", "parallel.zero=1"], "dp2": ["parallel.dp=2"],
               "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2 ZeRO-3": ["parallel.dp=2", "parallel.zero=3"]}
    runs = [(BASE + extra, str(tmp_path / name.replace(" ", "_"))) for name, extra in layouts.items()]
    reports = worlds(2).run(train_muon, runs)  # reports[rank][run]
    lines = []
    for i, name in enumerate(layouts):
        results = [r[i] for r in reports]
        lines.append(check(results, ref, name))
        owned = [r["owned"] for r in results]
        if name == "pp2":
            assert owned == [r["matrices"] for r in results] == [6, 6], owned  # each stage its own block
        else:
            assert sum(owned) == results[0]["matrices"] == 12 and max(owned) < 12, owned  # spread, each once
        sent = matrix_bytes(results)
        expected = {"dp2 ZeRO-1": results[0]["formula_bytes"], "dp2": HIDDEN * ELT, "tp2": HIDDEN * ELT,
                    "pp2": 0, "dp2 ZeRO-3": HIDDEN * ELT}[name]  # the closed forms where ranges are even
        assert sent == [expected] * STEPS == [results[0]["formula_bytes"]] * STEPS, (name, sent, expected)
    with capsys.disabled():
        print(f"\nMuon against the plain single-process Muon, {STEPS} steps:\n  " + "\n  ".join(lines))


def test_muon_at_2_2_2_with_zero_1_matches_a_plain_muon(worlds, tmp_path, capsys):
    """dp2 x tp2 x pp2 with ZeRO-1: each stage's 6 matrices spread over its 4 ranks, tp boxes and ZeRO
    ranges assembled; bytes per step (all ranks): tp's 2 N/2 per matrix + ZeRO's 2 (L - h) per tp box."""
    ref = reference_run(BASE)
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1", "pipeline.schedule=1f1b"]
    results = [r[0] for r in worlds(8).run(train_muon, [(BASE + layout, str(tmp_path / "222"))])]
    line = check(results, ref, "(2,2,2) ZeRO-1")
    assert [r["matrices"] for r in results] == [6] * 8 and sum(r["owned"] for r in results) == 12
    assert max(r["owned"] for r in results) < 6  # no rank orthogonalises its stage's every matrix
    sent = matrix_bytes(results)
    assert sent == [results[0]["formula_bytes"]] * STEPS and HIDDEN * ELT <= sent[0] <= 3 * HIDDEN * ELT, sent
    with capsys.disabled():
        print(f"\nMuon against the plain single-process Muon, {STEPS} steps: {line}")


def test_muon_state_saved_under_dp2_zero_1_resumes_under_tp2(worlds, tmp_path):
    """The momentum buffers (optimizer.momentum_buffer.<matrix>) and AdamW's moments go through the
    placement contract: saved at step 3 of 6 under dp2 ZeRO-1, resumed under tp2, the same parameters."""
    from threefold.checkpoint.format import step_dir_name

    saver = BASE + ["parallel.dp=2", "parallel.zero=1", "checkpoint.save_every=3"]
    ckpt = tmp_path / "saver" / "checkpoints" / step_dir_name(3)
    resumed = BASE + ["parallel.tp=2", f"checkpoint.resume={ckpt}"]
    reports = worlds(2).run(train_muon, [(saver, str(tmp_path / "saver")), (resumed, str(tmp_path / "resumed"))])
    want = assemble([r[0]["params"] for r in reports], [r[0]["placements"] for r in reports])
    got = assemble([r[1]["params"] for r in reports], [r[1]["placements"] for r in reports])
    worst = max((rel_err(got[k], v), k) for k, v in want.items())
    assert worst[0] <= TOL, worst
    assert len(reports[0][1]["losses"]) == STEPS - 3
