"""Deterministic mode (`--deterministic`, train.deterministic): bitwise-reproducible runs.

Two runs of the same layout on the same hardware and software give bit-identical losses and
parameters. What makes a run vary, and what fixes it:

* random state: Python's, NumPy's and torch's generators are seeded from train.seed (always;
  the model's weights and the data depend only on the seed anyway: models/decoder.py, data/).
* kernels: `torch.use_deterministic_algorithms(True)` (an op without a deterministic kernel
  raises instead of silently varying), cuDNN deterministic and without autotuning, cuBLAS with a
  fixed workspace (CUBLAS_WORKSPACE_CONFIG).
* reduction order across ranks: gloo's algorithms are fixed for a given world; NCCL is pinned to
  the ring algorithm and the simple protocol (NCCL_ALGO, NCCL_PROTO, unless already set) before
  its communicators are created, so its summation order does not depend on message size
  heuristics. threefold's own reductions already run in a fixed order: gradient buckets launch
  strictly in index order (parallel/buckets.py), and every loss / norm is reduced once.
* threads: the intra-op thread count is fixed per process (run.threads, train/threads.py).

Deterministic mode does not make different layouts bit-identical to each other (their sums
associate differently); that is what the parity harness measures, against tolerances.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


@dataclass
class _Saved:
    algorithms: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool


def set_deterministic_environment() -> None:
    """Before the process group starts: variables that NCCL and cuBLAS read when they start."""
    for key, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(key, value)


def configure_determinism(seed: int, deterministic: bool) -> _Saved:
    """Seed everything; in deterministic mode also pin kernels. Returns what `restore` needs."""
    saved = _Saved(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                   torch.backends.cudnn.benchmark)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        set_deterministic_environment()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return saved


def restore(saved: _Saved) -> None:
    """Undo the global switches (processes that run several jobs, such as test worlds)."""
    torch.use_deterministic_algorithms(saved.algorithms)
    torch.backends.cudnn.deterministic = saved.cudnn_deterministic
    torch.backends.cudnn.benchmark = saved.cudnn_benchmark
