"""Fused-attention rates from the FlashAttention-2 paper's figures (planner/kernel_data.py `_FWD_BWD`): the A100
presets run SDPA's FlashAttention-2 at its published rates, and llm-foundry's `attn_impl: triton` rows of the
validation set run its Triton FlashAttention at that kernel's (docs/planner.md, "Kernel calibration set")."""

from dataclasses import replace

from threefold.config import load_config
from threefold.planner.compute import attention_seconds, executed_attention_flops
from threefold.planner.hardware import PRESETS
from threefold.planner.kernel_data import ATTENTION, ATTENTION_SOURCES, TRITON_ON_H100, attention_tflops

MODEL = replace(load_config(None, ["model.preset=gpt3-175b"]).model, hidden=2048, heads=16, kv_heads=16, layers=24,
                ffn_hidden=8192, max_seq=2048)


def _pair_tflops(gpu, seq: int) -> float:
    """The forward + backward rate the planner gives a causal head-128 attention, in the paper's count
    (backward 2.5x the forward's executed FLOPs)."""
    rows = 8 * seq
    forward, backward = attention_seconds(MODEL, rows, seq, 1, "flash", gpu, "bf16")
    return 3.5 * executed_attention_flops(MODEL, rows, seq, 1, "flash") / (forward + backward) / 1e12


def test_the_a100_presets_run_flashattention_2_at_its_published_rates():
    # panel (d) of the A100 figure: FlashAttention-2 at 2k and 8k keys, forward + backward
    for kind in ("a100-80gb", "a100-40gb"):
        assert PRESETS[kind].attention_table == "a100/fa2"
        assert abs(_pair_tflops(PRESETS[kind], 2048) - 155) < 0.5
        assert abs(_pair_tflops(PRESETS[kind], 8192) - 182) < 0.5
    # the flat share charged before (0.6 of the peak, backward twice the forward's time) was 218 TFLOP/s
    flat = replace(PRESETS["a100-80gb"], attention_table="")
    assert abs(_pair_tflops(flat, 2048) - 3.5 * 0.6 * 312 / 3) < 0.5


def test_the_triton_kernel_is_the_papers_bars_and_on_h100_a_named_stand_in():
    assert attention_tflops("a100/triton", 2048) == (68, 68) and attention_tflops("a100/fa1", 2048) == (69, 69)
    assert ATTENTION["h100/triton"] == ATTENTION[TRITON_ON_H100] == ATTENTION["h100/fa1"]
    assert "stand-in" in ATTENTION_SOURCES["h100/triton"] and "FlashAttention-2" in ATTENTION_SOURCES["a100/triton"]


def test_llm_foundry_rows_take_the_kernel_their_sweep_ran():
    from tests.unit.test_planner_published import TRITON_ATTENTION
    from tests.unit.test_planner_validation import RUNS, software_gpu

    assert set(TRITON_ATTENTION) == {"MPT 13b, 512 H100", "MPT 30b, 512 H100", "MPT 3b, 8 H100 FP8"} | {
        f"MPT {size}, {gpus} A100" for size, gpus in (("70b", 64), ("30b", 8), ("13b", 8), ("7b", 8), ("3b", 8),
                                                      ("1b", 8))}
    table = {run[0]: software_gpu(run[0], run[2]).attention_table for run in RUNS}
    assert table["MPT 1b, 8 A100"] == "a100/triton" and table["MPT 13b, 512 H100"] == "h100/triton"
    assert table["MPT 7b, 512 H100"] == "h100/fa2" and table["torchtitan Llama 3 8B, 64 A100"] == "a100/fa2"
    assert table["MCore 1.7B, 48 H100"] == "h100/cudnn"
