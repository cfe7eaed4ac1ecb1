"""Gradient compression: communication hooks for the data-parallel reducer (parallel/data.py).

    method    hook                          what crosses dp per bucket
    none      DenseHook()                   the fp32 sum (ring, or hierarchical)
    fp16/bf16 DenseHook(wire_dtype)         the sum in 16 bits
    dgc       dgc.DGCHook                   top-k (bf16 values, int32 indices), all_gather
    onebit    onebit_adam.OneBitAdamHook    dense during warm-up, then 1-bit momentum (optimizer side)
              onebit.OneBitHook             (onebit_adam=false) 1-bit gradients, all_to_all + all_gather
    powersgd  powersgd.PowerSGDHook         rank-r factors P and Q, two all-reduces

A hook keeps its memory (residuals, momenta, warm-up position) as tensors in `bucket.state`
(transient entries start with "_"); `DataParallelReducer.state_dict()` exposes it for checkpoints.
"""

from __future__ import annotations

import torch

from ...config import Config
from .dense import DenseHook
from .dgc import DGCHook
from .onebit import OneBitAllReduce, OneBitHook
from .onebit_adam import OneBitAdam, OneBitAdamHook, adapt_optimizer
from .powersgd import PowerSGDHook

__all__ = ["make_comm_hook", "adapt_optimizer", "DenseHook", "DGCHook", "OneBitHook", "OneBitAllReduce",
           "OneBitAdam", "OneBitAdamHook", "PowerSGDHook"]


def make_comm_hook(cfg: Config, dp: int, reduce_dtype: torch.dtype | None = None):
    """The gradient hook for `cfg.compress` over a dp axis of size `dp` (1: nothing to compress).

    `reduce_dtype` is the wire dtype that mixed precision asks for when no compression is chosen.
    """
    c = cfg.compress
    if dp == 1:
        return DenseHook()  # a one-rank axis sends nothing: every method is a no-op
    if c.method in ("none", "fp16", "bf16"):
        wire = {"none": reduce_dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[c.method]
        return DenseHook(wire, c.hierarchical)
    if c.method == "dgc":
        return DGCHook(c.dgc_sparsity, c.dgc_warmup_steps, c.dgc_momentum, c.dgc_momentum_correction,
                       cfg.train.grad_clip if c.dgc_local_clip else 0.0, c.error_feedback)
    if c.method == "onebit":
        if c.onebit_adam:
            return OneBitAdamHook(c.warmup_steps, c.error_feedback)
        return OneBitHook(c.warmup_steps, c.error_feedback)
    if c.method == "powersgd":
        return PowerSGDHook(c.powersgd_rank, c.warmup_steps, c.error_feedback, cfg.train.seed, c.hierarchical)
    raise ValueError(f"unknown compression method {c.method!r}")
