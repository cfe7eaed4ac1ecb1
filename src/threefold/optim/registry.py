"""Every optimizer threefold runs, by name: the one dispatch on `train.optimizer`.

How to add one (docs/architecture.md): a file in optim/ with its `OptimizerEntry` (optim/entry.py:
how to make it, its states per parameter, whether it needs whole matrices) and one line in
`ENTRIES` below. `TrainConfig.optimizer`'s Literal lists the names a user may set.
"""

from __future__ import annotations

from ..config import TrainConfig
from . import adamw, muon, onebit_adam, sgd
from .entry import OptimizerEntry

ENTRIES: dict[str, OptimizerEntry] = {e.name: e for e in (adamw.ENTRY, sgd.ENTRY, muon.ENTRY, onebit_adam.ENTRY)}


def entry(name: str) -> OptimizerEntry:
    try:
        return ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(ENTRIES)}") from None


def optimizer_bytes(cfg: TrainConfig, precision: str, matrix_fraction: float = 1.0) -> float:
    """Optimizer bytes per trainable parameter (fp32 master included under 16-bit compute), a
    whole-matrix optimizer's states weighted by the fraction of parameters in hidden matrices."""
    e = entry(cfg.optimizer)
    on, off = e.bytes_per_param(cfg, precision, True)[2], e.bytes_per_param(cfg, precision, False)[2]
    return matrix_fraction * on + (1 - matrix_fraction) * off
