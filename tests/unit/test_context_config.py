"""parallel.cp / parallel.cp_method in the config: each bad input one line naming the key and the fix."""

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError


def _validate(*overrides: str, world: int = 2):
    return load_config(None, ["model.preset=tiny-llama", "train.seq_len=16", *overrides]).validate(world)


def test_cp_method_defaults_to_ring_and_takes_the_three_methods():
    assert _validate("parallel.cp=2").parallel.cp_method == "ring"
    for method in ("ring", "allgather", "ulysses"):
        assert _validate("parallel.cp=2", f"parallel.cp_method={method}").parallel.cp_method == method
    with pytest.raises(ConfigError, match="parallel.cp_method"):
        _validate("parallel.cp=2", "parallel.cp_method=flash")


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.cp=4", "train.seq_len=12"], 4,
     "train.seq_len: 12 is not a multiple of 2 x parallel.cp = 8 (the zigzag chunks of context parallelism); "
     "choose train.seq_len divisible by 8"),
    (["parallel.cp=4", "parallel.cp_method=ulysses"], 4,
     "parallel.cp_method: ulysses: 4 query heads and 2 key/value heads must both be divisible by parallel.cp=4; "
     "use parallel.cp_method=ring or allgather, or a cp dividing both"),
    (["parallel.cp=2", "model.preset=tiny-moe", "model.expert_capacity=1.25"], 2,
     "model.expert_capacity: 1.25: under context parallelism routing is dropless (capacity is a matter of "
     "positions, and each cp rank holds zigzag chunks); use model.expert_capacity=0 or parallel.cp=1"),
    (["parallel.cp=2", "model.preset=py:mymodel:build"], 2,
     "parallel.cp: model.preset=py:mymodel:build: a module of your own has no attention context parallelism can "
     "split; use threefold's own decoder or parallel.cp=1"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=ulysses", "model.preset=tiny-llama"], 4,
     "parallel.cp_method: ulysses: 4 query heads and 2 key/value heads must both be divisible by parallel.cp x "
     "parallel.tp = 4 (tp splits the heads first); use parallel.cp_method=ring or allgather, or a cp dividing both"),
    (["parallel.cp=2", "compress.method=powersgd"], 2, "compress.method: compress.method=powersgd with "
     "parallel.cp=2 is not wired yet; use parallel.cp=1 or drop it"),
])
def test_cp_refusals_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        _validate(*overrides, world=world)
    assert str(e.value) == message and "\n" not in e.value.line()


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=2", "pipeline.schedule=pipedream-2bw", "train.microbatches=2"],  # every schedule takes cp
    ["parallel.tp=2", "parallel.sequence_parallel=true", "model.preset=tiny-moe"],  # routing split over tp and cp
])
def test_cp_takes_pipedream_2bw_and_experts_under_sequence_parallelism(overrides):
    assert _validate("parallel.cp=2", *overrides, world=4).parallel.cp == 2


def test_cp_method_without_cp_has_no_effect_and_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.cp_method.*no effect unless parallel.cp > 1"):
        _validate("parallel.cp_method=ulysses", world=1)


def test_a_hf_architecture_outside_the_families_is_refused(tmp_path):
    """A config.json threefold cannot read (here: an architecture it does not build) has no attention seam
    (every family it builds has one)."""
    with pytest.raises(ConfigError) as e:
        _validate_context(_hf(tmp_path, {"model_type": "gptj", "architectures": ["GPTJForCausalLM"]}, "parallel.cp=2"))
    assert str(e.value) == (f"parallel.cp: the Hugging Face model hf:{tmp_path} has no attention "
                            "seam context parallelism can split (the families threefold builds have one: "
                            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                            "GPT2LMHeadModel, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM); use one "
                            "of them, "
                            "threefold's own decoder or parallel.cp=1") and "\n" not in e.value.line()


def _hf(directory, raw: dict, *overrides: str):
    """A config of threefold's decoder whose model.preset is then hf:`directory` (config.json `raw`)."""
    import dataclasses
    import json

    (directory / "config.json").write_text(json.dumps(raw))
    cfg = load_config(None, ["model.preset=tiny", "train.seq_len=16", *overrides])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=f"hf:{directory}"))


def _validate_context(cfg):
    from threefold.config.checks import _validate_context as validate

    return validate(cfg)


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("raw", [LLAMA, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
                                 {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                  "sliding_window": 4096},  # wider than the sequence: full causal
                                 {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8,
                                  "use_sliding_window": False}])
def test_the_dense_hf_families_take_cp_and_packing(tmp_path, raw):
    from threefold.config.checks import _validate_packing

    _validate_context(_hf(tmp_path, raw, "parallel.cp=2"))
    _validate_packing(_hf(tmp_path, raw, "data.pack=true", "data.sources=x:1"))


GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
MOES = [{"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
        {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "sliding_window": 4096},
        {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "sliding_window": 8,
         "use_sliding_window": False},
        {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "sliding_window": 8,
         "use_sliding_window": False}]


def test_gpt2_takes_cp_and_packing(tmp_path):
    """GPT-2's blocks have the attention seam and its embedding the learned positions' (models/hf_gpt2.py)."""
    from threefold.config.checks import _validate_packing

    _validate_context(_hf(tmp_path, GPT2, "parallel.cp=2"))
    _validate_packing(_hf(tmp_path, GPT2, "data.pack=true", "data.sources=x:1"))


@pytest.mark.parametrize("raw", MOES)
def test_the_hf_mixtures_of_experts_take_cp_but_not_packing(tmp_path, raw):
    """Their blocks have the attention seam (cp); packed rows stay refused for any mixture of experts."""
    from threefold.config.checks import _validate_packing

    _validate_context(_hf(tmp_path, raw, "parallel.cp=2", "model.experts=4"))
    with pytest.raises(ConfigError) as e:
        _validate_packing(_hf(tmp_path, raw, "data.pack=true", "data.sources=x:1", "model.experts=4"))
    assert str(e.value) == ("data.pack: packed rows with mixture-of-experts routing (model.experts=4) are not wired "
                            "yet; use a dense model or data.pack=false")


@pytest.mark.parametrize("raw, key", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8}, "parallel.cp=2"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "use_sliding_window": True,
      "max_window_layers": 1, "num_hidden_layers": 2}, "parallel.cp=2"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, "data.pack=true"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "sliding_window": 8}, "parallel.cp=2"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "sliding_window": 8,
      "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 2}, "parallel.cp=2"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "sliding_window": 8,
      "use_sliding_window": True}, "parallel.cp=2"),
])
def test_a_sliding_window_narrower_than_the_sequence_is_refused(tmp_path, raw, key):
    from threefold.config.checks import _validate_packing

    arch, off = raw["architectures"][0], key.split("=")[0]
    if key == "data.pack=true":
        with pytest.raises(ConfigError) as e:
            _validate_packing(_hf(tmp_path, raw, key, "data.sources=x:1"))
        off_value = "data.pack=false"
    else:
        with pytest.raises(ConfigError) as e:
            _validate_context(_hf(tmp_path, raw, key))
        off_value = "parallel.cp=1"
    assert str(e.value) == (f"{off}: the Hugging Face model hf:{tmp_path} ({arch}) has sliding-window attention (a "
                            "window of 8 tokens, narrower than train.seq_len=16), which the attention seam does not "
                            f"compute; use train.seq_len=8 or less, or {off_value}") and "\n" not in e.value.line()


def test_packing_keeps_its_other_refusals_for_a_hf_llama(tmp_path):
    from threefold.config.checks import _validate_packing

    with pytest.raises(ConfigError) as e:
        _validate_packing(_hf(tmp_path, LLAMA, "data.pack=true", "data.sources=x:1", "parallel.tp=2"))
    assert str(e.value) == ("data.pack: packed rows with parallel.tp=2 are not wired yet; use parallel.tp=1 or "
                            "data.pack=false")
    with pytest.raises(ConfigError, match=r"data.pack: the Hugging Face model hf:\S+ has no attention "
                                          "seam to mask by document"):
        _validate_packing(_hf(tmp_path, {"model_type": "gptj", "architectures": ["GPTJForCausalLM"]},
                              "data.pack=true", "data.sources=x:1"))
