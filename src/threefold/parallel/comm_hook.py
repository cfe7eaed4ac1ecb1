"""The data-parallel reducer's communication hook, chosen from the config's `compress` section.

Communication (comm/compression) takes plain arguments and never reads the config; this is where
the strategy side turns `compress.*` (and the mixed-precision wire dtype) into a hook.
"""

from __future__ import annotations

import torch

from ..comm.compression import DenseHook, DGCHook, OneBitAdamHook, OneBitHook, PowerSGDHook
from ..config import CompressConfig


def make_comm_hook(c: CompressConfig, grad_clip: float, seed: int, dp: int, reduce_dtype: torch.dtype | None = None):
    """The gradient hook for the `compress` section over a dp axis of size `dp` (1: nothing to compress).

    `grad_clip` (train.grad_clip) is DGC's local clip, `seed` (train.seed) PowerSGD's; `reduce_dtype` is the
    wire dtype that mixed precision asks for when no compression is chosen.
    """
    if dp == 1:
        return DenseHook()  # a one-rank axis sends nothing: every method is a no-op
    if c.method in ("none", "fp16", "bf16"):
        wire = {"none": reduce_dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[c.method]
        return DenseHook(wire, c.hierarchical)
    if c.method == "dgc":
        return DGCHook(c.dgc_sparsity, c.dgc_warmup_steps, c.dgc_momentum, c.dgc_momentum_correction,
                       grad_clip if c.dgc_local_clip else 0.0, c.error_feedback)
    if c.method == "onebit":
        if c.onebit_adam:
            return OneBitAdamHook(c.warmup_steps, c.error_feedback)
        return OneBitHook(c.warmup_steps, c.error_feedback)
    if c.method == "powersgd":
        return PowerSGDHook(c.powersgd_rank, c.warmup_steps, c.error_feedback, seed, c.hierarchical)
    raise ValueError(f"unknown compression method {c.method!r}")
