"""What kind of forward is running now: a training step's own, a recomputation, or an evaluation.

Most modules compute the same thing whatever the kind. A module with side effects - the
mixture-of-experts router, which tallies its routing for the metrics and adds auxiliary
losses - needs to know:

    recomputation   activation checkpointing runs a region's forward a second time during
                    backward (parallel/remat.py enters `recomputing()` around that run): the
                    same tensors must be produced again, but nothing is tallied twice
    evaluation      a forward whose loss is a validation loss although autograd runs (a
                    pipeline evaluates with its training schedule and discards the gradients):
                    `evaluating()`; no tally and no auxiliary loss, as under torch.no_grad()

Process-wide counters, not thread-locals: the autograd engine may run the recomputation on one
of its own threads while the thread that entered the context waits in backward().
"""

from __future__ import annotations

import contextlib

_recomputing = 0
_evaluating = 0


@contextlib.contextmanager
def recomputing():
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


@contextlib.contextmanager
def evaluating():
    global _evaluating
    _evaluating += 1
    try:
        yield
    finally:
        _evaluating -= 1


def is_recomputing() -> bool:
    return _recomputing > 0


def is_evaluating() -> bool:
    return _evaluating > 0
