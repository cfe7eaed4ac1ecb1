"""Gradients reduced in fp32 (Workload.grad_reduce): FSDP's reduce_dtype=float32, as Composer's `mixed_precision:
DEFAULT` sets it for llm-foundry's MPT benchmarks (composer/trainer/mosaic_fsdp_utils.py, v0.16.4 on), puts twice
the gradient bytes on the wire; the parameter all-gathers stay in the compute dtype (its param_dtype)."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.dp_comm import data_parallel
from threefold.planner.hardware import PRESETS
from threefold.planner.workload import Strategy, Workload

# no latency per collective step: the bytes alone set the time, so the ratios below are the bytes'
H100 = replace(PRESETS["h100-80gb"], intra_latency_s=0.0, inter_latency_s=0.0)


def total_s(zero: int, grad_reduce: str) -> float:
    m = load_config(None, ["model.preset=llama-7b"]).model
    st = Strategy(dp=512, zero=zero, microbatches=1, remat="none")
    return data_parallel(Workload(m, 512, 4096, grad_reduce=grad_reduce), st, H100, 0, 1.0, 0.5)[0]


def test_an_fp32_reduction_doubles_the_gradient_bytes_and_leaves_the_gathers():
    # ZeRO-0: one all-reduce of the gradients
    assert total_s(0, "fp32") / total_s(0, "compute") == pytest.approx(2.0, rel=0.02)
    # ZeRO-2 with one micro-batch: a reduce-scatter of the gradients and an all-gather of the parameters, both in
    # bf16 before; only the reduce-scatter doubles: (2 rs + ag) / (rs + ag), rs = ag
    assert total_s(2, "fp32") / total_s(2, "compute") == pytest.approx(1.5, rel=0.02)
    # ZeRO-3: two gathers and one reduce-scatter per micro-batch: 4 / 3
    assert total_s(3, "fp32") / total_s(3, "compute") == pytest.approx(4 / 3, rel=0.02)


def test_an_unknown_reduction_dtype_is_refused():
    m = load_config(None, ["model.preset=llama-7b"]).model
    with pytest.raises(ValueError, match="grad_reduce"):
        Workload(m, 8, 4096, grad_reduce="fp16")
