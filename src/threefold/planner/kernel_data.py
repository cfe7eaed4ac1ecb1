"""Published kernel measurements the planner's compute model is built from (planner/compute.py), by GPU kind.

This is the planner's kernel calibration set: single-GPU kernel benchmarks, each table with its source, and
nothing taken from a training run. The validation set (tests/unit/test_planner_validation.py, docs/planner.md)
holds whole training runs and is disjoint from it: no number here was read from, or chosen for, one of those runs.
When bench/planner_kernels.py has measured a GPU (measured-gpu.toml), that kind's measured shares replace these
tables (the file names no table: `attention_table = ""`, `gemm_fixed_us` as measured or 0).

GEMMs, H100 SXM5, BF16 (`H100_GEMM_BF16`): XLA's matmul performance table for sm_90
  (https://github.com/openxla/xla/blob/main/xla/service/gpu/model/matmul_interpolator_data.h, also vendored in
  tensorflow/tensorflow third_party/xla; entries `b: 1`, key "BF16xBF16->BF16", FLOP/s as published, here in
  TFLOP/s rounded to 0.1). Its largest GEMMs (4096 x 4096 x 4096: 786 TFLOP/s, 0.79 of the 989 dense peak) run
  faster than the preset's sustained plateau (`Gpu.gemm_efficiency` 0.74, hardware.py: ~0.2 ms kernels at boost
  clock, not the power-limited clocks of a training step), so the table does not set the plateau; what it shows
  that the tile and wave model misses is a fixed cost per GEMM: at K = 256-512 the measured time is 2-4x the FLOPs
  at the plateau. `H100_GEMM_FIXED_S` is that cost: the least-squares fit (in log time) of
  `gemm_seconds + fixed` to every entry below with the preset's plateau held (tests/unit/test_planner_kernels.py
  refits it). For the GEMMs of 1B-70B models (M x N >= 4096 x 2048, K >= 1024) the model is then within 15% of the
  table (the test holds it).

Fused causal attention, H100 80GB SXM5, BF16, head size 128 (`ATTENTION`): Shah et al. 2024, "FlashAttention-3:
  Fast and Accurate Attention with Asynchrony and Low-precision" (arXiv:2407.08608, https://arxiv.org/abs/2407.08608),
  figure 5 (forward, causal mask, head dim 128: FlashAttention-2, cuDNN, FlashAttention-3) and its backward figure
  (head dim 128), batch x sequence = 16k tokens, hidden 2048; TFLOP/s as the bars are labelled, the causal FLOPs
  counted as executed (half of the square). The backward runs 2.5x the forward's FLOPs (the paper's count).
  Which kernel a software runs: PyTorch's SDPA (threefold, torchtitan) picks FlashAttention-2 first
  (torch._C._get_sdp_priority_order() = flash, efficient, math, cudnn in torch 2.13; FlashAttention-3 is opt-in),
  llm-foundry's `attn_impl: flash` is the flash-attn 2 package, Megatron-Core runs Transformer Engine's cuDNN
  fused attention. Head sizes other than 128 take the 128 table; sequences outside 512-16k its end values.

Fused causal attention, A100 80GB SXM4 and H100 80GB SXM5, forward + backward (`_FWD_BWD`): Dao 2023,
  "FlashAttention-2" (arXiv:2307.08691), the benchmark figures of its repository (panel (d): causal, head dim 128):
  FlashAttention-2 ("a100/fa2", what PyTorch's SDPA runs on an A100 and the A100 presets' table), FlashAttention
  v1 and the Triton FlashAttention llm-foundry's `attn_impl: triton` runs; on H100 FlashAttention v1 (and, as a
  stand-in, the Triton kernel: see TRITON_ON_H100).
"""

from __future__ import annotations

import math

# (M, N, K, TFLOP/s): XLA's sm_90 table, b = 1, BF16 (module docstring)
H100_GEMM_BF16 = (
    (4096, 4096, 4096, 786.0), (4096, 4096, 1024, 681.1), (4096, 2048, 4096, 764.1), (2048, 4096, 2048, 717.5),
    (2048, 4096, 512, 449.6), (2048, 4096, 256, 300.3), (4096, 2048, 512, 448.1), (4096, 512, 2048, 527.4),
    (4096, 256, 4096, 398.9), (4096, 512, 256, 138.7), (2048, 1024, 4096, 659.1), (1024, 4096, 2048, 633.1),
    (1024, 2048, 2048, 526.3), (2048, 2048, 1024, 492.1), (512, 4096, 4096, 653.1), (1024, 4096, 512, 340.7),
    (4096, 256, 1024, 216.1), (1024, 1024, 4096, 465.6), (2048, 1024, 1024, 378.6), (1024, 1024, 1024, 246.7),
    (512, 2048, 4096, 463.2), (256, 4096, 4096, 435.8), (4096, 512, 512, 239.2), (2048, 512, 4096, 455.7),
    (2048, 1024, 512, 239.2),
)
H100_GEMM_SOURCE = "https://github.com/openxla/xla/blob/main/xla/service/gpu/model/matmul_interpolator_data.h (sm_90)"
# the fixed seconds per GEMM that fit the table with the preset's plateau (tests/unit/test_planner_kernels.py)
H100_GEMM_FIXED_S = 5.5e-6

ATTENTION_SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
FA3_PAPER = "Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608), H100 80GB SXM5, head dim 128"
# name -> (forward TFLOP/s, backward TFLOP/s) at ATTENTION_SEQUENCES, causal forward, head size 128
ATTENTION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "h100/fa2": ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
    "h100/cudnn": ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
    "h100/fa3": ((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
}
# Dao 2023, FlashAttention-2 (arXiv:2307.08691), its benchmark figures as published in the flash-attn repository
# (github.com/Dao-AILab/flash-attention, commit 4f285b35, assets/flash2_a100_fwd_bwd_benchmark.png and
# assets/flash2_h100_fwd_bwd_benchmark.png), panel (d): forward + backward, causal mask, head dim 128, batch x
# sequence = 16k tokens, hidden 2048, FLOPs counted as executed (half the square; backward 2.5x the forward). Each
# bar is the pair's one rate, so a table holds it for both passes (their sum takes the time the bar gives).
# "triton" is the Triton FlashAttention of that repository (flash_attn/flash_attn_triton.py), which llm-foundry
# copied as its `attn_impl: triton` (llmfoundry/models/layers/flash_attn_triton.py); "fa1" FlashAttention (v1).
FA2_PAPER = ("Dao 2023, FlashAttention-2 (arXiv:2307.08691), flash-attention 4f285b35 "
             "assets/flash2_{gpu}_fwd_bwd_benchmark.png (d): causal, head dim 128, forward + backward")
_FWD_BWD = {
    "a100/fa2": (99, 133, 155, 173, 182, 189),
    "a100/fa1": (55, 62, 69, 76, 80, 83),
    "a100/triton": (50, 61, 68, 74, 78, 80),
    "h100/fa1": (98, 109, 108, 126, 135, 137),
}
# The Triton kernel on an H100: no published figure. On the A100 it runs within 10% of FlashAttention (v1) at every
# length of panel (d) (50-80 against 55-83 TFLOP/s), both kernels of Ampere's instructions (triton-pre-mlir, the
# legacy Triton backend of December 2022 that llm-foundry pins, predates Hopper's), so the H100's takes FlashAttention's H100 bars: a
# stand-in, named as one (TRITON_ON_H100).
TRITON_ON_H100 = "h100/fa1"
_FWD_BWD["h100/triton"] = _FWD_BWD[TRITON_ON_H100]
ATTENTION.update({name: (rates, rates) for name, rates in _FWD_BWD.items()})
ATTENTION_SOURCES = {name: FA2_PAPER.format(gpu=name.split("/")[0]) if name in _FWD_BWD else FA3_PAPER
                     for name in ATTENTION}
ATTENTION_SOURCES["h100/triton"] += f"; no Triton bar on H100: {TRITON_ON_H100}'s, a stand-in (above)"
BACKWARD_FLOPS = 2.5  # a flash backward's FLOPs over its forward's (the FlashAttention papers' count)


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear in log2(x) between the table's points; its end values outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = next(i for i in range(1, len(xs)) if x <= xs[i])
    t = (math.log2(x) - math.log2(xs[i - 1])) / (math.log2(xs[i]) - math.log2(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def attention_tflops(table: str, seq_len: int) -> tuple[float, float]:
    """(forward, backward) TFLOP/s of the published fused causal attention `table` at `seq_len` keys."""
    forward, backward = ATTENTION[table]
    return _interpolate(ATTENTION_SEQUENCES, forward, seq_len), _interpolate(ATTENTION_SEQUENCES, backward, seq_len)
