"""Which family a `model` config names: a preset of the reference decoder, or PREFIX:REST.

`PREFIXES` maps a `model.preset` prefix to the function that builds the spec from the rest of the
name (`hf:DIR`: a Hugging Face directory, its architecture's module from config/families.py); a
preset without one of them is the reference decoder's. Adding a prefix is one entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import ModelConfig
from ..config.families import FAMILIES
from .spec import ModelSpec

HF_PREFIX = "hf:"


def model_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    """The spec of the model `cfg` describes, initialised from `seed` (weights: see checkpoint/hf.py)."""
    for prefix, build in PREFIXES.items():
        if cfg.preset.startswith(prefix):
            return build(cfg.preset[len(prefix):], cfg, seed)
    from .reference import decoder_spec

    return decoder_spec(cfg, seed)


def hf_spec(directory: Path, seed: int) -> ModelSpec:
    """A Hugging Face directory's spec, from the module its architecture's family names."""
    from .hf_causal import load_hf_config

    config = load_hf_config(directory)
    build = SPEC_MODULES[FAMILIES[config.architectures[0]].module]()
    return build(directory, config, seed)


def _py_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    from .py_module import py_spec

    return py_spec(cfg, seed)


def _causal():
    from .hf_causal import causal_spec

    return causal_spec


def _gpt2():
    from .hf_gpt2 import gpt2_spec

    return gpt2_spec


def _moe():
    from .hf_moe import moe_spec

    return moe_spec


# a family's module -> its spec function (directory, transformers config, seed) -> ModelSpec, imported
# only when asked for (each module pulls in transformers)
SPEC_MODULES: dict[str, Callable[[], Callable[[Path, object, int], ModelSpec]]] = {
    "hf_causal": _causal, "hf_gpt2": _gpt2, "hf_moe": _moe}

# model.preset prefix -> build(rest of the name, the model config, seed)
PREFIXES: dict[str, Callable[[str, ModelConfig, int], ModelSpec]] = {
    HF_PREFIX: lambda rest, cfg, seed: hf_spec(Path(rest), seed),
    "py:": lambda rest, cfg, seed: _py_spec(cfg, seed),  # a user's own nn.Module (models/py_module.py)
}
