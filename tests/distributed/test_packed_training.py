"""Packed documents in training (data.pack=true, gloo, CPU): whole documents packed into rows, attention
masked at document boundaries, positions restarting per document, the loss over the counted targets
only. Against one packed process over 4 steps - per-step loss and gradient norm, the validation loss
and every final parameter within relative 1e-5 - at cp = 2 and 4 (ring, allgather, ulysses; tiny-llama
with RoPE, tiny with learned positions; ulysses at cp = 4 with 4 kv heads) and at dp = 2 (the count of
counted targets summed over dp); and a packed run resumed from its checkpoint continues bitwise. Each
world size runs all its cases in one call (tests/composition_tasks.py `train_many`).

Independent of threefold's masking: one packed step by the trainer - one process, cp = 2 (ring,
allgather, ulysses), cp = 4 ring - against the plain decoder run on each document alone, per tensor,
at weights and on rows where the document mask changes the result (test_a_packed_step_is_each_document_alone)."""

import random

import pytest
import torch

from threefold.checkpoint.format import step_dir_name

from tests.case_runs import assert_parameters_match, assert_steps_match, run_by_world_size
from tests.composition_tasks import train_many
from tests.data_helpers import write_prepared
from tests.helpers import make_config, rel_err

STEPS = 4
DATA = "data.source={prepared}"  # written by the fixture: documents of 3 to 40 tokens, a validation split
BASE = ["train.global_batch=4", "train.seq_len=32", "train.lr=1e-3", "train.eps=1e-6", f"train.steps={STEPS}",
        "train.microbatches=2", "data.pack=true", DATA, "train.eval_every=3", "train.eval_batches=1"]
LLAMA = ["model.preset=tiny-llama"] + BASE
LLAMA_KV4 = LLAMA + ["model.kv_heads=4"]  # ulysses at cp = 4 splits the kv heads too
GPT = ["model.preset=tiny"] + BASE
TOL = 1e-5
SAVED = 2  # the step whose checkpoint a one-process packed run resumes from


def _cases():
    """name -> (world size, overrides, reference overrides)."""
    cases = {}
    for cp, method, ref in ((2, "ring", LLAMA), (2, "allgather", LLAMA), (2, "ulysses", LLAMA),
                            (4, "ring", LLAMA), (4, "allgather", LLAMA), (4, "ulysses", LLAMA_KV4)):
        cases[f"llama cp{cp} {method}"] = (cp, ref + [f"parallel.cp={cp}", f"parallel.cp_method={method}"], ref)
    cases["gpt cp2 ring"] = (2, GPT + ["parallel.cp=2"], GPT)  # learned positions, per document
    cases["llama dp2"] = (2, LLAMA + ["parallel.dp=2"], LLAMA)  # the counted targets summed over dp
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    rng = random.Random(0)
    docs = [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 41))] for _ in range(70)]
    return write_prepared(tmp_path_factory.mktemp("prepared"), docs[:60], docs[60:], vocab=256)


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory, prepared):
    root = tmp_path_factory.mktemp("packed")

    def concrete(overrides):
        return [o.format(prepared=prepared) if o == DATA else o for o in overrides]

    cases = {name: (n, concrete(ov), ref) for name, (n, ov, ref) in CASES.items()}
    out = run_by_world_size(worlds, train_many, cases, root)
    refs = sorted({tuple(ref) for _, _, ref in CASES.values()})
    saved = (concrete(LLAMA + [f"checkpoint.save_every={SAVED}"]), str(root / "saved"))
    resume = (concrete(LLAMA + [f"checkpoint.resume={root / 'saved' / 'checkpoints' / step_dir_name(SAVED)}"]),
              str(root / "resumed"))
    single = worlds(1).run(train_many, [(concrete(ref), str(root / f"ref{i}")) for i, ref in enumerate(refs)]
                           + [saved, resume])[0]
    out["refs"] = dict(zip(refs, single))
    out["saved"], out["resumed"] = single[-2], single[-1]
    out["root"], out["prepared"] = root, prepared
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_packed_training_matches_one_process(runs, name):
    results, ref = runs[name], runs["refs"][tuple(CASES[name][2])]
    assert_steps_match(name, results, ref, TOL, steps=STEPS)
    assert_parameters_match(name, results, ref, TOL)
    assert len(ref["val"]) == 2
    for rank_result in results:  # every rank: the validation loss over the counted targets of every shard
        for got, want in zip(rank_result["val"], ref["val"]):
            assert abs(got - want) <= TOL * abs(want), (name, rank_result["val"], ref["val"])


def test_the_loss_is_the_mean_over_the_counted_targets(runs):
    """metrics.jsonl names the counted targets of every step: fewer than global_batch x seq_len (padding
    and each document's last target left out), and the same under cp (summed over dp and cp)."""
    import json

    def targets(directory):
        return [json.loads(line)["targets"] for line in (directory / "metrics.jsonl").read_text().splitlines()]

    ref = targets(runs["root"] / "ref0")
    assert len(ref) == STEPS and all(0 < t < 4 * 32 for t in ref) and len(set(ref)) > 1
    assert targets(runs["root"] / "saved") == ref


def test_a_packed_run_resumes_bitwise(runs):
    saved, resumed = runs["saved"], runs["resumed"]
    assert resumed["resumed_from"] == step_dir_name(SAVED)
    assert resumed["losses"] == saved["losses"][SAVED:]
    assert resumed["norms"] == saved["norms"][SAVED:]
    for key, value in saved["params"].items():
        assert torch.equal(resumed["params"][key], value), key


# ------------------------------------------------------------------ each document alone, where the mask matters

PEAKED = ["model.init_std=0.3", "train.steps=1"]  # attention far from uniform at step 1


def peaked(overrides: list[str], prepared) -> list[str]:
    """One step of `overrides` on the prepared data at PEAKED weights, without the validation."""
    return [o.format(prepared=prepared) if o == DATA else o for o in overrides
            if not o.startswith(("train.eval", "train.steps"))] + PEAKED
ALONE = {  # name -> (world size, the layout's overrides); tiny-llama's RoPE, tiny's learned positions
    "llama one process": (1, LLAMA), "gpt one process": (1, GPT),
    **{f"llama cp2 {m}": (2, LLAMA + ["parallel.cp=2", f"parallel.cp_method={m}"]) for m in ("ring", "allgather",
                                                                                             "ulysses")},
    "gpt cp2 ring": (2, GPT + ["parallel.cp=2"]),
    "llama cp4 ring": (4, LLAMA + ["parallel.cp=4"]),  # documents across every rank's two chunks
}


def _model(overrides: list[str]) -> tuple[str, ...]:
    return tuple(o for o in overrides if o.startswith("model."))


def packed_gradients(runs: list[tuple[list[str], str]]) -> list[dict]:
    """Each run: one packed step by the trainer; its loss and the gradient it applied, per parameter
    (after the sync over dp and cp: every rank holds the whole of each)."""
    from threefold.train.trainer import Trainer

    out = []
    for overrides, directory in runs:
        trainer = Trainer(make_config(overrides, directory))
        sync, grads = trainer.parallel.grad_sync, {}
        finish = sync.finish

        def finish_and_keep():  # the gradients as the sync leaves them, before the norm, the clip and the update
            finish()
            grads.update({n: p.grad.detach().clone() for n, p in trainer.parallel.module.named_parameters()
                          if p.grad is not None})

        sync.finish = finish_and_keep
        (record,) = trainer.run()
        out.append({"loss": record["loss"], "targets": record["targets"], "grads": grads})
    return out


def _pieces(batch, r: int, whole_rows: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of row r's documents, each alone: its counted inputs, then the target of the last
    of them (uncounted targets are IGNORE_INDEX). `whole_rows`: the row as one piece, its counted targets."""
    from threefold.models.cross_entropy import IGNORE_INDEX

    ids, counted = batch.packing.documents[r], batch.packing.counted[r]
    if whole_rows:
        return [(batch.inputs[r][None], batch.targets[r].masked_fill(~counted, IGNORE_INDEX)[None])]
    pieces = []
    for d in ids.unique().tolist():
        mine = (ids == d) & counted
        pieces.append((batch.inputs[r][ids == d][: int(mine.sum())][None], batch.targets[r][mine][None]))
    return pieces


def each_document_alone(cfg, batch, whole_rows: bool = False) -> tuple[float, int, dict]:
    """The mean token loss over every counted target of `batch` and its gradient per parameter, from the
    plain decoder (causal SDPA over its input, positions from 0, no document ids) run on each document
    alone. `whole_rows`: every row run whole instead, the same targets counted (no document mask,
    positions 0 .. seq_len - 1: what the packed step computes without the mask)."""
    from threefold.models.cross_entropy import IGNORE_INDEX
    from threefold.models.decoder import build_model

    model = build_model(cfg.model, cfg.train.seed)
    total, count = 0.0, 0
    for r in range(batch.inputs.shape[0]):
        for inputs, targets in _pieces(batch, r, whole_rows):
            n = int((targets != IGNORE_INDEX).sum())
            if n:  # a document of one token, or padding: no target
                loss = model(inputs, targets)
                loss.backward()
                total, count = total + loss.item(), count + n
    return total / count, count, {n: p.grad / count for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def documents_alone(worlds, tmp_path_factory):
    from threefold.data.build import build_samplers

    root = tmp_path_factory.mktemp("alone")
    rng = random.Random(1)  # documents of 2 to 12 tokens: step 1's rows hold 4 each, 1 to 11 counted targets apiece
    prepared = write_prepared(root / "prepared", [[rng.randrange(1, 256) for _ in range(rng.randrange(2, 13))]
                                                  for _ in range(40)], vocab=256)
    cases = {name: (n, peaked(ov, prepared)) for name, (n, ov) in ALONE.items()}
    out = {}
    for size in sorted({n for n, _ in cases.values()}):
        names = [name for name, (n, _) in cases.items() if n == size]
        per_rank = worlds(size).run(packed_gradients, [(cases[k][1], str(root / f"{size}-{i}"))
                                                       for i, k in enumerate(names)])
        out.update({name: [r[i] for r in per_rank] for i, name in enumerate(names)})
    refs = {}
    for model in {_model(ov) for _, ov in ALONE.values()}:
        cfg = make_config(peaked(BASE, prepared) + list(model), str(root / "unused")).validate(1)
        sampler, _ = build_samplers(cfg.data, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed,
                                    cfg.model.vocab)
        batch = sampler.step_batch(0)
        refs[model] = each_document_alone(cfg, batch), each_document_alone(cfg, batch, whole_rows=True)
    return out, refs


@pytest.mark.parametrize("name", list(ALONE))
def test_a_packed_step_is_each_document_alone(documents_alone, name):
    """The trainer's packed step (the document mask, positions restarting per document, the loss over the
    counted targets) against the plain decoder on each document alone, per tensor: the loss and every
    parameter's gradient (as the sync leaves it, before the update) within relative TOL on every rank.
    At these weights (init_std 0.3) attention is peaked: the same rows run whole, without the document
    mask, are more than 100 x TOL away in the loss (~1%) and in every gradient (~100%), so a mask lost
    on any path fails here. TOL: fp32 rounding only (the summation orders differ between a packed row and
    its pieces, and between cp's partial attentions): measured at most 2e-6 in a gradient, 1e-8 in the loss."""
    runs, refs = documents_alone
    results = runs[name]
    (loss, count, grads), (unmasked_loss, unmasked_count, unmasked) = refs[_model(ALONE[name][1])]
    assert unmasked_count == count and abs(unmasked_loss - loss) > 100 * TOL * loss
    for key, want in grads.items():
        assert rel_err(unmasked[key], want) > 100 * TOL, key
    for rank, result in enumerate(results):
        assert result["targets"] == count
        assert abs(result["loss"] - loss) <= TOL * loss, (name, rank, result["loss"], loss)
        assert set(result["grads"]) == set(grads)
        for key, want in grads.items():
            err = rel_err(result["grads"][key], want)
            assert err <= TOL, f"{name} rank {rank}: the gradient of {key} differs by {err:.2e}"
