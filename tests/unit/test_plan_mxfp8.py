"""`threefold plan --precision mxfp8` (planner/mx.py): native on Blackwell only, bf16's plan elsewhere.

Expected numbers are derived here from docs/planner.md's MXFP8 model: a converted linear's three GEMMs at
the fp8 peak (the tensorwise kernel's price), plus its casts - each operand (x, W, dY) cast in two layouts,
each reading it twice in bf16 (2 + 2) and writing an e4m3 element and 1/32 of an e8m0 scale - and 18
cast kernels; it replaces the linear's bf16 forward GEMM (the backward twice it, as for every linear).
"""

import json
from dataclasses import replace

import pytest

from threefold.cli import main
from threefold.config import load_config
from threefold.planner.compute import _fp8_gemm_seconds, block_linear_shapes, gemm_seconds
from threefold.planner.hardware import PRESETS
from threefold.planner.memory import stage_memory
from threefold.planner.mx import mx_linear_seconds, mx_native
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload

B200, H100 = PRESETS["b200-192gb"], PRESETS["h100-80gb"]
CAST_BYTES_PER_ELEMENT = 2 * (2 + 2 + 1 + 1 / 32)  # two layouts x (amax read, cast read, e4m3 write, scale share)
CAST_KERNELS = 18


def llama7b() -> Workload:
    return Workload(load_config(None, ["model.preset=llama-7b"]).model, 8, 4096)


def expected_mx_linear(m: int, k: int, n: int, gpu) -> float:
    gemms = _fp8_gemm_seconds(m, n, k, gpu, "tensorwise") + _fp8_gemm_seconds(m, k, n, gpu, "tensorwise") \
        + _fp8_gemm_seconds(k, n, m, gpu, "tensorwise")
    return gemms + CAST_BYTES_PER_ELEMENT * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s + CAST_KERNELS * gpu.op_overhead_s


def test_blackwell_is_native_and_hopper_is_not():
    assert mx_native(B200) and not any(mx_native(PRESETS[k]) for k in ("h100-80gb", "h200-141gb", "h800-80gb",
                                                                          "a100-80gb"))
    assert mx_linear_seconds(4096, 4096, 4096, H100) == float("inf")
    assert mx_linear_seconds(4096, 4096, 11008, B200) == pytest.approx(expected_mx_linear(4096, 4096, 11008, B200),
                                                                       rel=1e-12)


def test_on_b200_each_converted_linear_trades_its_bf16_gemm_for_its_mxfp8_cost():
    """pp=1, 32 blocks: the first and last stay bf16, so the forward saves 30 x (sum over the 4 linears of
    bf16 forward GEMM - a third of the MXFP8 forward + backward) / compute_efficiency, and the backward twice that."""
    w = llama7b()
    st = Strategy(dp=8, zero=3, microbatches=1)
    bf16 = step_time(w, st, B200)
    mx = step_time(w, replace(st, precision="mxfp8"), B200)
    rows = st.micro_batch_size(w) * w.seq_len
    shapes = block_linear_shapes(w.model, rows, 1)
    saving = sum(gemm_seconds(m, n, k, B200) - expected_mx_linear(m, k, n, B200) / 3 for m, k, n in shapes.values())
    assert saving > 0
    assert bf16.forward_s - mx.forward_s == pytest.approx(30 * saving / B200.compute_efficiency, rel=1e-9)
    assert bf16.backward_s - mx.backward_s == pytest.approx(2 * 30 * saving / B200.compute_efficiency, rel=1e-9)


def test_on_b200_the_transient_holds_the_largest_gemms_cast_operands_with_their_scales():
    """llama-7b, one 4096-token sequence per micro-batch: the largest converted GEMM is the fused gate/up
    (M = 4096 tokens, K = 4096, N = 2 x 11008), its input gradient the largest GEMM: dY (M x N) and W (N x K)
    cast, 2 x 4096 x 22016 elements of 33/32 bytes."""
    w = llama7b()
    st = Strategy(dp=8, zero=3, microbatches=1)
    bf16 = stage_memory(w, st, 0, B200)
    mx = stage_memory(w, replace(st, precision="mxfp8"), 0, B200)
    assert mx.transient - bf16.transient == 33 / 32 * 2 * 4096 * (2 * 11008)
    assert (mx.params, mx.grads, mx.optimizer, mx.activations) == (bf16.params, bf16.grads, bf16.optimizer,
                                                                   bf16.activations)


# one layout (the search is another file's matter): llama-7b on 8 GPUs, ZeRO-3, no recomputation
LAYOUT = ["--global-batch", "64", "--dp", "8", "--tp", "1", "--pp", "1", "--zero", "3", "--microbatches", "8",
          "--activation-checkpointing", "none"]


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_on_h100_the_plan_is_bf16s_and_says_why(capsys):
    args = ["--model", "llama-7b", "--gpus", "8", "--gpu", "h100-80gb", *LAYOUT]
    bf16, mx = plan_json(capsys, *args), plan_json(capsys, *args, "--precision", "mxfp8")
    keys = ("step_time_s", "memory_bytes", "tokens_per_s")
    assert [{k: c[k] for k in keys} for c in mx["candidates"]] == [{k: c[k] for k in keys} for c in bf16["candidates"]]
    assert mx["mxfp8"]["native"] is False and mx["mxfp8"]["gaining"] == []
    assert "h100-80gb has no MX tensor cores" in mx["mxfp8"]["line"]
    assert "mxfp8" not in bf16


def test_b200_plan_converts_and_lands_between_bf16_and_fp8(capsys):
    args = ["--model", "llama-7b", "--gpus", "8", "--gpu", "b200-192gb", *LAYOUT]
    rate = {p: plan_json(capsys, *args, "--precision", p)["candidates"][0]["tokens_per_s"] for p in ("bf16", "mxfp8", "fp8")}
    assert rate["bf16"] < rate["mxfp8"] < rate["fp8"]  # MX's casts move more bytes than tensorwise's
    out = plan_json(capsys, *args, "--precision", "mxfp8")["mxfp8"]
    assert out["native"] and out["gaining"] == ["qkv", "attn_out", "mlp_up", "mlp_down"]


def test_a_tp_that_splits_an_mx_block_is_refused_and_never_searched(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--tp", "2", "--precision", "mxfp8"]) == 2
    err = capsys.readouterr().err
    assert "--tp" in err and "32" in err and len(err.strip().splitlines()) == 1
    out = plan_json(capsys, "--model", "tiny", "--gpus", "2", "--precision", "mxfp8")
    assert {c["tp"] for c in out["candidates"]} == {1}
    assert {c["tp"] for c in plan_json(capsys, "--model", "tiny", "--gpus", "2")["candidates"]} == {1, 2}
