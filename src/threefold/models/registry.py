"""Which family a `model` config names: a preset of the reference decoder, or `hf:DIR`."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from .spec import ModelSpec

HF_PREFIX = "hf:"


def model_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    """The spec of the model `cfg` describes, initialised from `seed` (weights: see checkpoint/hf.py)."""
    if cfg.preset.startswith(HF_PREFIX):
        return hf_spec(Path(cfg.preset[len(HF_PREFIX):]), seed)
    if cfg.preset.startswith("py:"):  # a user's own nn.Module (models/py_module.py)
        from .py_module import py_spec

        return py_spec(cfg, seed)
    from .reference import decoder_spec

    return decoder_spec(cfg, seed)


def hf_spec(directory: Path, seed: int) -> ModelSpec:
    """A Hugging Face directory's spec, from the module of its architecture (GPT-2, a mixture of
    experts, or a dense Llama-style family)."""
    from ..config.hf import MOE
    from .hf_causal import load_hf_config

    config = load_hf_config(directory)
    if config.architectures[0] == "GPT2LMHeadModel":
        from .hf_gpt2 import gpt2_spec

        return gpt2_spec(directory, config, seed)
    if config.architectures[0] in MOE:
        from .hf_moe import moe_spec

        return moe_spec(directory, config, seed)
    from .hf_causal import causal_spec

    return causal_spec(directory, config, seed)
