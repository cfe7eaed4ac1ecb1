"""Which family a `model` config names: a preset of the reference decoder, or `hf:DIR`."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig
from .spec import ModelSpec

HF_PREFIX = "hf:"


def model_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    """The spec of the model `cfg` describes, initialised from `seed` (weights: see checkpoint/hf.py)."""
    if cfg.preset.startswith(HF_PREFIX):
        from .hf_causal import hf_spec

        return hf_spec(Path(cfg.preset[len(HF_PREFIX):]), seed)
    from .reference import decoder_spec

    return decoder_spec(cfg, seed)
