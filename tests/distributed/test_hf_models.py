"""Bring your own model: Hugging Face decoders built with `transformers` from small configs and
saved with save_pretrained (nothing downloaded), trained by threefold under several layouts and
compared with the library model's own single-process training loop (plain torch AdamW on the
from_pretrained weights, the same batches)."""

import pytest
import torch

from tests.helpers import rel_err

pytest.importorskip("transformers")

from tests.hf_tasks import (  # noqa: E402
    STEPS, TRAIN, reference_training, save_tiny, start_memory, train_hf, train_hf_many, train_with_logits)

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gpt2")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    extra = {"qwen3": {"head_dim": 16}, "qwen2": {"tie_word_embeddings": True}, "gpt2": {"n_inner": 128}}
    return {f: save_tiny(f, root / f, **extra.get(f, {})) for f in FAMILIES}


def _key_of(family: str):
    from threefold.models import hf_causal, hf_gpt2
    from threefold.models.spec import HFFormat

    return HFFormat((hf_gpt2 if family == "gpt2" else hf_causal).HF_RENAMES).key_of


def _check_parity(result: dict, reference: dict, what: str) -> None:
    key_of = _key_of(what.split()[0])
    losses = [abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"])]
    assert len(losses) == STEPS and max(losses) <= 1e-5, f"{what}: losses differ by {max(losses):.2e}"
    ref = reference["params"]
    errors = {name: rel_err(p, ref[key_of(name)]) for name, p in result["params"].items()}
    worst = max((e, n) for n, e in errors.items())
    assert worst[0] <= 1e-5, f"{what}: {worst[1]} differs by {worst[0]:.2e}"
    trained = [n for n in ref if "k_proj.bias" not in n]
    assert {key_of(n) for n in result["params"]} >= set(trained), f"{what}: parameters missing"
    moved = max(rel_err(ref[n], reference["initial"][n]) for n in trained)
    assert moved > 1e-3, f"{what}: the reference did not train"


def _reference(directory, overrides):
    from safetensors.torch import load_file

    ref = reference_training(directory, overrides)
    ref["initial"] = load_file(str(directory / "model.safetensors"))
    return ref


def test_llama_layouts_match_the_transformers_training_loop(worlds, hf_dirs, tmp_path):
    base = [f"model.preset=hf:{hf_dirs['llama']}", *TRAIN]
    reference = _reference(hf_dirs["llama"], base)
    (single,) = worlds(1).run(train_hf_many, [(base, str(tmp_path / "111"))])[0]
    _check_parity(single, reference, "llama (1,1,1)")
    runs = {"(2,2,1)": ["parallel.dp=2", "parallel.tp=2"],
            "(1,2,2)": ["parallel.tp=2", "parallel.pp=2", "train.microbatches=2"],
            "(2,1,2)": ["parallel.dp=2", "parallel.pp=2", "train.microbatches=2", "pipeline.schedule=gpipe"],
            "(2,2,1) ZeRO-3": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]}
    results = worlds(4).run(train_hf_many, [(base + o, str(tmp_path / str(i))) for i, o in enumerate(runs.values())])
    for rank_results in results:
        for what, result in zip(runs, rank_results):
            _check_parity(result, reference, f"llama {what}")


def test_qwen_mistral_and_gpt2_match_the_transformers_training_loop(worlds, hf_dirs, tmp_path):
    """Qwen2 (q/k/v biases, tied embedding) at (2,2,1) with sequence parallelism and ZeRO-1, Mistral at
    (2,1,2) with the zero-bubble schedule and ZeRO-2, Qwen3 (per-head q/k norms) at (1,2,2) with 1F1B
    and ZeRO-3, GPT-2 (fused q/k/v: a strided placement) at (2,2,1) with sequence parallelism and ZeRO-3."""
    layouts = {"gpt2": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3"],
               "qwen2": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=1"],
               "mistral": ["parallel.dp=2", "parallel.pp=2", "train.microbatches=2", "pipeline.schedule=zb-h1",
                           "parallel.zero=2"],
               "qwen3": ["parallel.tp=2", "parallel.pp=2", "train.microbatches=2", "parallel.zero=3"]}
    bases = {f: [f"model.preset=hf:{hf_dirs[f]}", *TRAIN] for f in layouts}
    references = {f: _reference(hf_dirs[f], bases[f]) for f in layouts}
    runs = [(bases[f] + o, str(tmp_path / f)) for f, o in layouts.items()]
    for rank_results in worlds(4).run(train_hf_many, runs):
        for family, result in zip(layouts, rank_results):
            _check_parity(result, references[family], family)


def test_load_train_export_round_trip_under_2_2_2(worlds, hf_dirs, tmp_path):
    """Loaded weights give the library's logits before any step; the trained model exported with
    --hf opens with from_pretrained and gives the trained model's logits; step 0 exports bitwise."""
    import transformers

    from threefold.checkpoint.hf import export_hf

    directory = hf_dirs["llama"]
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(5))
    base = [f"model.preset=hf:{directory}", *TRAIN, "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
            "train.microbatches=2", f"checkpoint.save_every={STEPS}"]
    results = worlds(8).run(train_hf, base, str(tmp_path / "run"), tokens, True)
    library = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    with torch.no_grad():
        expected = library(input_ids=tokens).logits
    last_stage = [r for r in results if r["before"] is not None]
    assert len(last_stage) == 4  # (dp, tp) ranks of the last stage
    for r in last_stage:
        assert rel_err(r["before"], expected) <= 1e-5
    export_hf(tmp_path / "run" / "checkpoints" / "step-00000000", tmp_path / "step0", shard_bytes=40_000)
    export_hf(tmp_path / "run", tmp_path / "last", shard_bytes=40_000)
    from safetensors.torch import load_file

    original = load_file(str(directory / "model.safetensors"))
    exported = {}
    for file in (tmp_path / "step0").glob("model-*.safetensors"):
        exported.update(load_file(str(file)))
    assert exported.keys() == original.keys() and len(list((tmp_path / "step0").glob("model-*"))) > 1
    assert all(torch.equal(exported[k], original[k]) for k in original)
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "last"))
    with torch.no_grad():
        logits = trained(input_ids=tokens).logits
    for r in last_stage:
        assert rel_err(logits, r["after"]) <= 1e-5
    assert rel_err(logits, expected) > 1e-3  # training changed the model


def test_each_rank_reads_and_holds_only_its_share(worlds, hf_dirs, tmp_path):
    """(2,2,2) start: model-tensor bytes held and safetensors bytes read per rank <= 1/4 of the model +
    the largest tensor (the measurement on a 350 MB model: bench/hf_start_memory.py)."""
    from safetensors.torch import load_file

    directory = hf_dirs["llama"]
    whole = load_file(str(directory / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in whole.values())
    largest = max(t.numel() * t.element_size() for t in whole.values())
    overrides = [f"model.preset=hf:{directory}", *TRAIN, "parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]
    results = worlds(8).run(start_memory, overrides, str(tmp_path))
    for r in results:
        assert r["allocated"] <= total / 4 + largest, r  # everything materialise ever allocated
        assert r["held"] <= total / 4 + largest, r
        assert 0 < r["read"] <= total / 4 + largest, r


def test_reference_decoder_exports_as_llama_and_gpt2(worlds, tmp_path):
    """threefold's own decoder, trained under tp=2 (Llama variant: GQA, biases, rotary pairs permuted to the
    library's halves) and pp=2 (GPT variant: q/k/v fused into c_attn), exported with --hf: transformers'
    from_pretrained gives threefold's logits."""
    import transformers

    from threefold.checkpoint.hf import export_hf

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
    quick = ["train.global_batch=4", "train.seq_len=16", "train.steps=3", "checkpoint.save_every=3"]
    runs = {"llama": ["model.preset=tiny-llama", "model.bias=true", "parallel.tp=2"],
            "gpt2": ["model.preset=tiny", "parallel.pp=2", "train.microbatches=2"]}
    results = worlds(2).run(train_with_logits, [(o + quick, str(tmp_path / f)) for f, o in runs.items()], tokens)
    archs = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
    for i, family in enumerate(runs):
        export_hf(tmp_path / family, tmp_path / f"{family}-hf")
        library = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{family}-hf"))
        assert type(library).__name__ == archs[family]
        with torch.no_grad():
            logits = library(input_ids=tokens).logits
        ours = [r[i]["after"] for r in results if r[i]["after"] is not None]
        errors = [rel_err(logits, t) for t in ours]
        assert ours and max(errors) <= 1e-5, f"{family}: logits differ by {errors}"


def test_reference_decoder_without_a_library_equivalent_refuses_hf_export():
    from types import SimpleNamespace

    from threefold.checkpoint.format import CheckpointError
    from threefold.checkpoint.hf import _hf_format_of

    mixed = {"preset": "tiny", "position": "rope"}  # GPT-2's layer norm and GELU with rotary positions
    with pytest.raises(CheckpointError, match="neither Llama's .* nor GPT-2's"):
        _hf_format_of(SimpleNamespace(config={"model": mixed}))
    with pytest.raises(CheckpointError, match="model.kv_heads=2 < heads has no GPT-2 equivalent"):
        _hf_format_of(SimpleNamespace(config={"model": {"preset": "tiny", "kv_heads": 2}}))


# Per-step relative loss difference allowed against the fp32 library loop: one unit roundoff of the
# compute format (as tests/distributed/test_zero_precision.py), > 0 to show it computed in that format.
ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def test_strategies_on_hugging_face_models(worlds, hf_dirs, tmp_path):
    """One 4-process world: a 4-layer Llama loaded from sharded files + index under the interleaved
    schedule with full activation checkpointing (parity 1e-5); GPT-2 under tp with async checkpoints,
    resumed from its step-3 checkpoint (bitwise the uninterrupted run); 1-bit Adam compression (its
    warm-up exactly the library loop, then compressed momentum only); bf16 and fp16 compute."""
    sharded = save_tiny("llama", tmp_path / "sharded", shard="40KB", num_hidden_layers=4)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    llama4 = [f"model.preset=hf:{sharded}", *TRAIN]
    gpt2 = [f"model.preset=hf:{hf_dirs['gpt2']}", *TRAIN]
    llama = [f"model.preset=hf:{hf_dirs['llama']}", *TRAIN]
    async_ckpt = ["checkpoint.save_every=3", "checkpoint.async_save=true", "checkpoint.keep=0"]
    runs = {
        "interleaved": llama4 + ["parallel.tp=2", "parallel.pp=2", "train.microbatches=4",
                                 "pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "remat.policy=full"],
        "async": gpt2 + ["parallel.dp=2", "parallel.tp=2", *async_ckpt],
        "resumed": gpt2 + ["parallel.dp=2", "parallel.tp=2",
                           f"checkpoint.resume={tmp_path / 'async' / 'checkpoints' / 'step-00000003'}"],
        "onebit": llama + ["parallel.dp=4", "compress.method=onebit", "compress.warmup_steps=3"],
        "bf16": llama + ["parallel.dp=2", "parallel.tp=2", "precision.compute=bf16"],
        "fp16": gpt2 + ["parallel.dp=2", "parallel.pp=2", "train.microbatches=2", "precision.compute=fp16"],
    }
    references = {"interleaved": _reference_sharded(sharded, llama4), "gpt2": _reference(hf_dirs["gpt2"], gpt2),
                  "llama": _reference(hf_dirs["llama"], llama)}
    results = worlds(4).run(train_hf_many, [(o, str(tmp_path / name)) for name, o in runs.items()])
    for rank_results in results:
        got = dict(zip(runs, rank_results))
        _check_parity(got["interleaved"], references["interleaved"], "llama interleaved + remat, sharded files")
        _check_parity(got["async"], references["gpt2"], "gpt2 async checkpoints")
        assert got["resumed"]["losses"] == got["async"]["losses"][3:]
        assert all(torch.equal(p, got["async"]["params"][n]) for n, p in got["resumed"]["params"].items())
        onebit, ref = got["onebit"], references["llama"]["losses"]
        assert max(abs(a - b) / b for a, b in zip(onebit["losses"][:4], ref)) <= 1e-5  # step 4: loss before update
        assert "all_reduce" not in onebit["comm"][-1] and onebit["comm"][-1]["all_to_all"] > 0
        assert onebit["losses"][-1] < onebit["losses"][0]
        for dtype, family in (("bf16", "llama"), ("fp16", "gpt2")):
            worst = max(abs(a - b) / b for a, b in zip(got[dtype]["losses"], references[family]["losses"]))
            assert 0 < worst <= ROUNDOFF[dtype], (dtype, worst)
            assert got[dtype]["dtypes"] == {getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])}


def _reference_sharded(directory, overrides):
    from safetensors.torch import load_file

    ref = reference_training(directory, overrides)
    ref["initial"] = {k: v for f in directory.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    return ref
