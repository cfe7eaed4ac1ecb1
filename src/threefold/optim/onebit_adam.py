"""1-bit Adam's entry: AdamW's states; built by the gradient compression, not by `make`
(compress.method=onebit with compress.onebit_adam=true swaps the AdamW over the masters for
comm/compression/onebit_adam.py's `OneBitAdam`, which keeps the same exp_avg and exp_avg_sq)."""

from __future__ import annotations

from .adamw import KINDS
from .entry import OptimizerEntry

ENTRY = OptimizerEntry("onebit_adam", None, lambda cfg, matrix: KINDS,
                       summary="1-bit Adam: AdamW's states, momentum exchanged in 1 bit (compress.method=onebit)")
