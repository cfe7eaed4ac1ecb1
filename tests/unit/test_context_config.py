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
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.preset=tiny-moe"], 4,
     "parallel.sequence_parallel: model.preset=tiny-moe: mixture-of-experts routing with both sequence "
     "parallelism and parallel.cp=2 (the sequence split over tp and cp) is not wired yet; use "
     "parallel.sequence_parallel=false or parallel.cp=1"),
    (["parallel.cp=2", "model.preset=py:mymodel:build"], 2,
     "parallel.cp: model.preset=py:mymodel:build: a module of your own has no attention context parallelism can "
     "split; use threefold's own decoder or parallel.cp=1"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=ulysses", "model.preset=tiny-llama"], 4,
     "parallel.cp_method: ulysses: 4 query heads and 2 key/value heads must both be divisible by parallel.cp x "
     "parallel.tp = 4 (tp splits the heads first); use parallel.cp_method=ring or allgather, or a cp dividing both"),
    (["parallel.cp=2", "parallel.pp=2", "pipeline.schedule=pipedream-2bw", "train.microbatches=2"], 4,
     "pipeline.schedule: pipedream-2bw (weights updated without a flush) with parallel.cp=2 is not wired yet; "
     "choose a synchronous schedule or parallel.cp=1"),
    (["parallel.cp=2", "compress.method=powersgd"], 2, "compress.method: compress.method=powersgd with "
     "parallel.cp=2 is not wired yet; use parallel.cp=1 or drop it"),
])
def test_cp_refusals_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        _validate(*overrides, world=world)
    assert str(e.value) == message and "\n" not in e.value.line()


def test_cp_method_without_cp_has_no_effect_and_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.cp_method.*no effect unless parallel.cp > 1"):
        _validate("parallel.cp_method=ulysses", world=1)


def test_hf_family_is_refused_naming_it(tmp_path):
    import dataclasses
    import json

    from threefold.config.checks import _validate_context

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    cfg = load_config(None, ["model.preset=tiny", "train.seq_len=16", "parallel.cp=2"])
    hf = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=f"hf:{tmp_path}"))
    with pytest.raises(ConfigError) as e:
        _validate_context(hf)
    assert str(e.value).startswith(f"parallel.cp: the Hugging Face model hf:{tmp_path} (LlamaForCausalLM) has no "
                                   "attention seam context parallelism can split")
