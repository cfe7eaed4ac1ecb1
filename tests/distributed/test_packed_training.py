"""Packed documents in training (data.pack=true, gloo, CPU): whole documents packed into rows, attention
masked at document boundaries, positions restarting per document, the loss over the counted targets
only. Against one packed process over 6 steps - per-step loss and gradient norm, the validation loss
and every final parameter within relative 1e-5 - at cp = 2 and 4 (ring, allgather, ulysses; tiny-llama
with RoPE, tiny with learned positions; ulysses at cp = 4 with 4 kv heads) and at dp = 2 (the count of
counted targets summed over dp); and a packed run resumed from its checkpoint continues bitwise. Each
world size runs all its cases in one call (tests/composition_tasks.py `train_many`)."""

import random

import pytest
import torch

from threefold.checkpoint.format import step_dir_name

from tests.case_runs import assert_parameters_match, assert_steps_match, run_by_world_size
from tests.composition_tasks import train_many
from tests.data_helpers import write_prepared

STEPS = 6
DATA = "data.source={prepared}"  # written by the fixture: documents of 3 to 40 tokens, a validation split
BASE = ["train.global_batch=4", "train.seq_len=32", "train.lr=1e-3", "train.eps=1e-6", f"train.steps={STEPS}",
        "train.microbatches=2", "data.pack=true", DATA, "train.eval_every=3", "train.eval_batches=1"]
LLAMA = ["model.preset=tiny-llama"] + BASE
LLAMA_KV4 = LLAMA + ["model.kv_heads=4"]  # ulysses at cp = 4 splits the kv heads too
GPT = ["model.preset=tiny"] + BASE
TOL = 1e-5
SAVED = 3  # the step whose checkpoint a one-process packed run resumes from


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
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    rng = random.Random(0)
    docs = [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 41))] for _ in range(70)]
    prepared = write_prepared(root / "prepared", docs[:60], docs[60:], vocab=256)

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


def test_the_first_step_is_the_mean_over_each_document_alone(runs):
    """Independent of the layouts: step 1's loss and gradient norm of the one-process packed run equal
    the mean token loss over every counted target of the global batch, and the norm of its gradient,
    computed by the plain model on each document of the batch alone (positions from 0)."""
    from threefold.data.build import build_samplers
    from threefold.models.decoder import build_model

    from tests.helpers import make_config

    cfg = make_config([o.format(prepared=runs["prepared"]) if o == DATA else o for o in LLAMA],
                      str(runs["root"] / "unused")).validate(1)
    sampler, _ = build_samplers(cfg.data, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.model.vocab)
    model = build_model(cfg.model, cfg.train.seed)
    batch = sampler.step_batch(0)
    total, count = 0.0, 0
    for r in range(batch.inputs.shape[0]):
        ids, counted = batch.packing.documents[r], batch.packing.counted[r]
        for d in ids.unique().tolist():
            where = (ids == d) & counted
            if where.any():  # a document's counted targets: its inputs, then the target of the last of them
                inputs = batch.inputs[r][ids == d][: int(where.sum())][None]
                loss = model(inputs, batch.targets[r][where][None])
                loss.backward()
                total, count = total + loss.item(), count + int(where.sum())
    norm = torch.cat([p.grad.flatten() / count for p in model.parameters() if p.grad is not None]).norm().item()
    ref = runs["refs"][tuple(LLAMA)]
    assert abs(ref["losses"][0] - total / count) <= TOL * total / count, (ref["losses"][0], total / count)
    assert abs(ref["norms"][0] - norm) <= TOL * norm, (ref["norms"][0], norm)
