"""Sliding-window attention of Mistral (every layer) and Qwen2 (the layers from max_window_layers on)
with a window of 16 at seq 64: losses and every parameter within relative 1e-5 of the library
model's own training loop (its own sliding-window mask) under (1,1,1), tp=2, sp with selective recomputation, and pp=2."""

import json

import pytest

from tests.helpers import rel_err

pytest.importorskip("transformers")

from tests.hf_tasks import reference_training, save_tiny, train_hf_many  # noqa: E402

STEPS = 6
TRAIN = ["train.global_batch=4", "train.seq_len=64", "train.min_lr_ratio=1.0", f"train.steps={STEPS}"]
WINDOWS = {"mistral": dict(sliding_window=16),
           "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)}
LAYOUTS = {"(1,2,1)": ["parallel.tp=2"], "(1,2,1) sp + remat": ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                                     "remat.policy=selective"],
           "(1,1,2)": ["parallel.pp=2", "train.microbatches=2"]}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return {f: save_tiny(f, root / f, **w) for f, w in WINDOWS.items()}


def _check(result, reference, what):
    from threefold.models.hf_causal import HF_RENAMES
    from threefold.models.spec import HFFormat

    key_of = HFFormat(HF_RENAMES).key_of
    losses = [abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"])]
    assert len(losses) == STEPS and max(losses) <= 1e-5, f"{what}: losses differ by {max(losses):.2e}"
    errors = {n: rel_err(p, reference["params"][key_of(n)]) for n, p in result["params"].items()}
    worst = max((e, n) for n, e in errors.items())
    assert worst[0] <= 1e-5, f"{what}: {worst[1]} differs by {worst[0]:.2e}"


def test_sliding_window_matches_the_transformers_training_loop(worlds, windowed, tmp_path):
    import transformers

    qwen = transformers.AutoConfig.from_pretrained(str(windowed["qwen2"]))
    assert qwen.layer_types == ["full_attention", "sliding_attention"]  # one layer of each
    bases = {f: [f"model.preset=hf:{d}", *TRAIN] for f, d in windowed.items()}
    references = {f: reference_training(windowed[f], bases[f]) for f in windowed}
    singles = worlds(1).run(train_hf_many, [(bases[f], str(tmp_path / f"{f}-1")) for f in windowed])[0]
    for family, result in zip(windowed, singles):
        _check(result, references[family], f"{family} (1,1,1)")
    runs = [(bases[f] + o, str(tmp_path / f"{f}-{i}")) for f in windowed for i, o in enumerate(LAYOUTS.values())]
    names = [f"{f} {what}" for f in windowed for what in LAYOUTS]
    for rank_results in worlds(2).run(train_hf_many, runs):
        for what, result in zip(names, rank_results):
            _check(result, references[what.split()[0]], what)


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                          ("layer_types", ["full_attention", "chunked_attention"])])
def test_attention_a_family_does_not_compute_is_refused(tmp_path, field, value):
    from threefold.errors import UserError
    from threefold.config.hf import read_config_json

    directory = save_tiny("llama", tmp_path / "llama")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(UserError) as e:
        read_config_json(directory)
    assert field in str(e.value) and "\n" not in str(e.value)
