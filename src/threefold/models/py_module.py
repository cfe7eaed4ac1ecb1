"""`model.preset = "py:MODULE:FACTORY"`: a user's own nn.Module trained by `threefold train`.

The contract: MODULE is importable from the working directory or PYTHONPATH; FACTORY() takes no
arguments and returns an nn.Module that maps token ids (batch, seq) to logits (batch, seq, V) and
has an integer attribute `vocab_size` (= V, which `model.vocab` must equal) and at least one
parameter that requires a gradient. Importing MODULE or calling FACTORY must not exit: a
`sys.exit` there (any code) is refused in one line naming it, as is a module with nothing to
train. The loss is the summed next-token cross-entropy of the batch's targets, unless the module defines `loss(batch)`: then that
(a 0-dim tensor, summed over the batch's tokens; `batch.inputs`, `batch.targets` are (b, s) ids).
threefold divides it by the global batch's token count, as for its own families.

The spec has no plan, no pipeline adapter and no init by name: `parallelize` takes the module path
(parallel/module.py), the factory runs under `torch.manual_seed(train.seed)` on every rank and dp
rank 0's values are broadcast. Nothing here knows about processes.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .spec import CausalAdapter, ModelSpec

PY_PREFIX = "py:"


def load_factory(preset: str):
    """The FACTORY callable of `py:MODULE:FACTORY`, imported from the working directory or PYTHONPATH."""
    module_name, _, factory_name = preset[len(PY_PREFIX):].partition(":")
    if not module_name or not factory_name:
        raise ConfigError("model.preset", f"'{preset}' is not py:MODULE:FACTORY (e.g. py:mymodels:make_model)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError("model.preset", f"cannot import '{module_name}' ({e}); run from its directory or add it "
                          "to PYTHONPATH") from None
    except SystemExit as e:
        raise ConfigError("model.preset", f"importing '{module_name}' called sys.exit({e.code!r}); a model module "
                          "must not exit on import (put its script part under if __name__ == '__main__')") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError("model.preset", f"'{module_name}' has no callable '{factory_name}'")
    return factory


def token_loss(module: nn.Module, batch) -> torch.Tensor:
    """The summed next-token cross-entropy of `batch` (or the module's own `loss(batch)`)."""
    own = getattr(type(module), "loss", None)
    if callable(own):
        return module.loss(batch)
    logits = module(batch.inputs)
    return F.cross_entropy(logits.float().flatten(0, -2), batch.targets.reshape(-1), reduction="sum")


def py_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    factory = load_factory(cfg.preset)

    def build() -> nn.Module:
        try:
            module = factory()
        except SystemExit as e:
            raise ConfigError("model.preset", f"{cfg.preset}() called sys.exit({e.code!r}); the factory must "
                              "return the nn.Module") from None
        if not isinstance(module, nn.Module):
            raise ConfigError("model.preset", f"{cfg.preset}() returned {type(module).__name__}, not an nn.Module")
        params = list(module.parameters())
        if not any(p.requires_grad for p in params):
            held = f"its {len(params)} parameters all have requires_grad=False" if params else "it has no parameters"
            raise ConfigError("model.preset", f"{cfg.preset}() returned a module with nothing to train ({held}); "
                              "return one with trainable parameters")
        vocab = getattr(module, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ConfigError("model.preset", f"{cfg.preset}(): the module needs an integer attribute vocab_size")
        if vocab != cfg.vocab:
            raise ConfigError("model.vocab", f"{cfg.vocab}, but {cfg.preset}'s vocab_size is {vocab}; "
                              f"set model.vocab={vocab}")
        return module

    def no_init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        raise RuntimeError("a py: module keeps its factory's values")

    return ModelSpec("py", build, plan=lambda tp: None, adapter=CausalAdapter(), init=no_init,
                     module_loss=token_loss, selective=())
