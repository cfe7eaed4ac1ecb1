"""The planner's matmul speed from GEMM shapes (planner/compute.py): roofline, tile and wave quantization."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.compute import block_forward_seconds, gemm_seconds, quantization_efficiency
from threefold.planner.hardware import PRESETS, load_gpu

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]


def achieved(m, n, k, gpu):
    return 2 * m * n * k / gemm_seconds(m, n, k, gpu) / gpu.peak_flops


def test_a_large_gemm_reaches_the_published_plateau():
    for gpu in (A100, H100):
        assert achieved(8192, 8192, 8192, gpu) == pytest.approx(gpu.gemm_efficiency, rel=0.04)


def test_a_thin_gemm_is_memory_bound():
    # K = 64: 2 m n k FLOPs over ~m n elements, intensity ~64 FLOP/byte, below the H100's ~220 at 0.74 of peak
    m = n = k = 8192
    seconds = gemm_seconds(m, n, 64, H100)
    assert seconds == pytest.approx(2 * (m * 64 + 64 * n + m * n) / H100.hbm_bytes_per_s + H100.gemm_fixed_s)
    assert achieved(m, n, 64, H100) < 0.5 * H100.gemm_efficiency
    del k


def test_wave_quantization_leaves_the_last_wave_partly_idle():
    sms = H100.sms
    full = quantization_efficiency(256 * sms, 128, sms)  # exactly one wave of the largest tile
    assert full == pytest.approx(1.0)
    over = quantization_efficiency(256 * sms + 256, 128, sms)  # one tile more: a second, nearly empty wave
    assert over < 0.9
    # tile quantization (one multiprocessor: no waves to fill): a dimension just above a tile multiple pads
    assert quantization_efficiency(257, 128, 1) < 0.9 * quantization_efficiency(256, 128, 1)


def test_small_blocks_run_slower_than_large_ones():
    """The issue's point: one flat share is too high for small models and too low for large ones."""
    base = load_config(None, ["model.preset=gpt3-175b"]).model

    def share(hidden, tp, gpu):
        m = replace(base, hidden=hidden, heads=hidden // 128, kv_heads=hidden // 128, ffn_hidden=4 * hidden)
        seconds, flops = block_forward_seconds(m, 1, 4096, tp, tp > 1, "flash", gpu, "bf16")
        return flops / seconds / gpu.peak_flops

    small, large = share(2048, 1, H100), share(18432, 8, H100)
    assert small < 0.9 * large
    assert large > 0.6  # the GEMMs of h = 18432 over tp 8 run near the plateau (x compute_efficiency)


def test_a_gpu_file_sets_the_gemm_model(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('[gpu]\npeak_tflops = 500\nmemory_gib = 64\nhbm_tbps = 3\nnvlink_gbps = 200\nib_gbps = 400\n'
                    'sms = 100\ngemm_efficiency = 0.7\nattention_efficiency = 0.5\ncompute_efficiency = 0.9\n')
    gpu = load_gpu(str(path))
    assert (gpu.sms, gpu.gemm_efficiency, gpu.attention_efficiency, gpu.compute_efficiency) == (100, 0.7, 0.5, 0.9)
    path.write_text('[gpu]\npeak_tflops = 500\nmemory_gib = 64\nhbm_tbps = 3\nnvlink_gbps = 200\nib_gbps = 400\n')
    defaults = load_gpu(str(path))
    assert (defaults.sms, defaults.gemm_efficiency) == (A100.sms, A100.gemm_efficiency)
