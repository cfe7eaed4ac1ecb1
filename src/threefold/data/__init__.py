"""Token sources: tokenizers, document sources, prepared shards, epochs, mixtures, the sampler.

The package imports lazily: `threefold data ...` and the worker processes of `data prepare`
need neither torch nor the sampler.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Batch": ".sampler", "Sampler": ".sampler", "load_tokens": ".sources"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
