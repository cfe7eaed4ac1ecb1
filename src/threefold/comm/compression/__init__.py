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
The hooks take plain arguments; parallel/comm_hook.py picks one from the config.
"""

from __future__ import annotations

from .dense import DenseHook
from .dgc import DGCHook
from .hook import CommHook, StatelessHook
from .onebit import OneBitAllReduce, OneBitHook
from .onebit_adam import OneBitAdam, OneBitAdamHook
from .powersgd import PowerSGDHook

__all__ = ["CommHook", "StatelessHook", "DenseHook", "DGCHook", "OneBitHook", "OneBitAllReduce",
           "OneBitAdam", "OneBitAdamHook", "PowerSGDHook"]
