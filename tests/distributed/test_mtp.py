"""Multi-token prediction (models/mtp.py) trained by threefold against a plain PyTorch loop.

The reference is tests/unit/test_mtp.py's `plain_loss` (a Llama decoder and DeepSeek-V3's MTP depths
written out, on the parameters by name, each depth on its row cut to s - k positions), starting from
threefold's initial weights, with `torch.optim.AdamW`, `clip_grad_norm_` and the warm-up + cosine
rate written out (tests/distributed/test_reference.py). Loss and every parameter after 3 steps,
relative 1e-5 per tensor, under (1,1,1), dp2, tp2 with a tied embedding (the head's vocabulary
slice also embeds the depths' tokens), ZeRO-1 and ZeRO-3 at dp2, and under pipeline parallelism with
the depths on the last stage and its own copy of the embedding (pipeline/adapter.py): pp2 1F1B,
pp2 interleaved over 4 layers with a tied embedding, pp2 dp2 ZeRO-1; the copies of a weight held by
several ranks (the two ends' embeddings, dp replicas) agree exactly. The (1,1,1) run's checkpoint
then exports: to Hugging Face without the depths (one line says so; transformers' logits match
threefold's), to DCP with them. Packed rows: one packed step against the plain depths on each
document alone."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tests.composition_tasks import train_many
from tests.distributed.test_reference import lr_at
from tests.helpers import make_config, rel_err
from tests.unit.test_mtp import plain_loss
from tests.zero_tasks import assemble
from threefold.checkpoint.dcp import export_dcp
from threefold.checkpoint.hf import export_hf
from threefold.checkpoint.logit_check import check_export
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model

BASE = ["model.preset=tiny-llama", "model.mtp_depth=2", "model.mtp_weight=0.5", "train.global_batch=4",
        "train.seq_len=16", "train.steps=3", "train.microbatches=2", "train.lr=2e-3", "train.warmup_steps=2",
        "train.min_lr_ratio=0.1", "train.weight_decay=0.1", "train.eps=1e-6", "train.grad_clip=0.5",
        "train.eval_every=0"]
LAYOUTS = {"dp2": ["parallel.dp=2"], "tp2-tied": ["parallel.tp=2", "model.tie_embeddings=true"],
           "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"], "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
           "pp2": ["parallel.pp=2"], "pp2-interleaved-tied-4layers": ["parallel.pp=2", "pipeline.schedule=interleaved",
                                                                      "pipeline.virtual_stages=2", "model.layers=4",
                                                                      "model.tie_embeddings=true"]}
FOUR = {"pp2-dp2-zero1": ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]}  # 4 ranks
TOL = 1e-5


def reference_run(overrides: list[str]) -> dict:
    """One process, the whole global batch per step: (main + MTP) summed losses / the batch's tokens."""
    cfg = make_config(overrides, "unused")
    t, m = cfg.train, cfg.model
    model = build_model(m, t.seed)
    p = {n: q.detach().clone().requires_grad_() for n, q in model.named_parameters()}  # tied: once
    groups = [{"params": [q for q in p.values() if q.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [q for q in p.values() if q.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    sampler = Sampler(load_tokens(cfg.data.source, m.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    losses, extras = [], []
    for step in range(1, t.steps + 1):
        batch = sampler.step_batch(step - 1)
        rows = torch.cat([batch.inputs, batch.targets[:, -1:]], 1)
        main, extra = plain_loss(p, rows, m)
        loss = (main + extra) / batch.targets.numel()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        optimizer.step()
        losses.append(float(loss.detach()))
        extras.append(float(extra.detach()) / batch.targets.numel())
    return {"losses": losses, "extras": extras, "params": {n: q.detach() for n, q in p.items()}}


def errors(results: list[dict], ref: dict) -> tuple[float, tuple[float, str]]:
    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    got = assemble([r["params"] for r in results], [r["placements"] for r in results])
    copies = {}  # (global name, boxes) -> the first rank's local tensor: every other copy equals it exactly
    for r in results:
        for name, local in r["params"].items():
            place = r["placements"][name]
            first = copies.setdefault((place.name, repr(place.boxes())), local)
            assert torch.equal(first, local), f"the copies of {place.name} differ between ranks"
    assert got.keys() == ref["params"].keys()
    return loss, max((rel_err(got[k], v), k) for k, v in ref["params"].items())


def model_of(name: str) -> tuple[bool, bool]:
    """(tied embedding, 4 layers) of a layout's model."""
    return "tied" in name, "4layers" in name


def test_mtp_trains_as_the_plain_loop_under_every_layout(worlds, tmp_path, capsys):
    refs = {(tied, four): reference_run(BASE + (["model.tie_embeddings=true"] if tied else [])
                                        + (["model.layers=4"] if four else []))
            for tied, four in {model_of(name) for name in (*LAYOUTS, *FOUR)}}
    plain = refs[False, False]
    assert plain["extras"][0] > 0.3 * plain["losses"][0]  # the depths weigh in the loss
    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    single = worlds(1).run(train_many, [(BASE + ["checkpoint.save_every=3"], str(tmp_path / "single"))])[0][0]
    per_rank = {world: worlds(world).run(train_many, [(BASE + overrides, str(tmp_path / name))
                                                      for name, overrides in layouts.items()])
                for world, layouts in ((2, LAYOUTS), (4, FOUR))}
    lines = []
    for name, results in [("(1,1,1)", [single]), *((n, [r[j] for r in per_rank[world]])
                                                   for world, layouts in ((2, LAYOUTS), (4, FOUR))
                                                   for j, n in enumerate(layouts))]:
        loss, (param, worst) = errors(results, refs[model_of(name)])
        lines.append(f"{name}: loss {loss:.1e} params {param:.1e} ({worst})")
        assert loss <= TOL and param <= TOL, lines[-1]
    with capsys.disabled():
        print("\nmulti-token prediction against the plain PyTorch loop, 3 steps:\n  " + "\n  ".join(lines))
    for name in ["single", *LAYOUTS, *FOUR]:  # metrics.jsonl's mtp_loss: the weighted depth losses per main token
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        want = refs[model_of(name)]["extras"]
        got = [r["mtp_loss"] for r in records]
        assert len(got) == len(want) and all(abs(a - b) <= TOL * abs(b) for a, b in zip(got, want)), (name, got, want)
        assert all(len(r["mtp_ce"]) == 2 and min(r["mtp_ce"]) > 0 for r in records)
    exports_drop_the_depths_for_hugging_face_only(tmp_path)


def exports_drop_the_depths_for_hugging_face_only(tmp_path: Path) -> None:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        export_hf(tmp_path / "single", tmp_path / "hf")
    assert err.getvalue().splitlines() == ["threefold: export: 2 multi-token-prediction modules dropped (no place "
                                           "in the Hugging Face format)"]
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not any("mtp" in k for k in keys)
    check = check_export(tmp_path / "single", tmp_path / "hf")  # transformers' forward against threefold's
    assert check is not None and check.ok, check
    _, tensors, _ = export_dcp(tmp_path / "single", tmp_path / "dcp")
    model = build_model(make_config(BASE, "unused").model, 0)
    assert tensors == len(dict(model.named_parameters()))  # the depths' tensors included


def test_a_packed_step_is_each_document_alone_with_its_depths(worlds, tmp_path):
    """data.pack: one packed step by the trainer (one process, peaked weights: the document mask changes the
    result) against `plain_loss` on each document alone - the depths' targets never cross a boundary and
    their attention is masked by document - loss and every gradient within relative 1e-5."""
    import random

    from tests.data_helpers import write_prepared
    from tests.distributed.test_packed_training import BASE as PACKED, _pieces, packed_gradients, peaked
    from threefold.data.build import build_samplers

    rng = random.Random(1)
    prepared = write_prepared(tmp_path / "prepared", [[rng.randrange(1, 256) for _ in range(rng.randrange(2, 13))]
                                                      for _ in range(40)], vocab=256)
    overrides = peaked(PACKED, prepared) + ["model.preset=tiny-llama", "model.mtp_depth=2", "model.mtp_weight=0.5"]
    (got,) = worlds(1).run(packed_gradients, [(overrides, str(tmp_path / "run"))])[0]
    cfg = make_config(overrides, str(tmp_path / "unused")).validate(1)
    sampler, _ = build_samplers(cfg.data, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.model.vocab)
    batch = sampler.step_batch(0)
    p = {n: q.detach().clone().requires_grad_() for n, q in build_model(cfg.model, cfg.train.seed).named_parameters()}
    total, count, longest = 0.0, 0, 0
    for r in range(batch.inputs.shape[0]):
        for inputs, targets in _pieces(batch, r, whole_rows=False):
            if targets.numel():  # a document of one token, or padding: no target
                main, extra = plain_loss(p, torch.cat([inputs, targets[:, -1:]], 1), cfg.model)
                (main + extra).backward()
                total, count, longest = total + float((main + extra).detach()), count + targets.numel(), \
                    max(longest, targets.numel())
    assert longest > 3 and got["targets"] == count  # documents long enough for both depths
    assert abs(got["loss"] - total / count) <= TOL * total / count, (got["loss"], total / count)
    for name, q in p.items():
        assert rel_err(got["grads"][name], q.grad / count) <= TOL, name
