"""Published runs added to the validation set (docs/planner.md, "Validation set"), each read from its source.

Two sources, each row's layout and batch as published, on the GPU the source names, real memory:

- torchtitan's end-2024 H100 benchmark (github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md;
  torchtitan commit 9dec370, torch 1963fc8, torchao eab345c): Llama 3.1 8B, 70B and 405B, FSDP2 / FSDP + TP /
  FSDP + TP + PP, bf16 and Float8, tokens/s per GPU ("TPS/GPU") and the measured peak memory ("Memory(GiB)",
  the maximum over GPUs). Hardware (the file's "Hardware" section): Grand Teton hosts of 8 H100 "with 96GB HBM2e
  with 2.4 TB/sec", 400 Gb/s per GPU across hosts, 500 W power limit; its footnote 2: the dense peak "is between
  SXM and NVL, and we don't know its exact value" - these rows take the SXM's 989 TFLOP/s, as the source's
  own MFU does (the planner's upper bound for these GPUs). What the file leaves to the configs of that commit:
  sequence 8,192 (train_configs/llama3_*.toml), one micro-batch per step (no gradient accumulation in torchtitan
  then; "local batch size" is the micro-batch), pipeline micro-batches = pp degree and two stages per rank for
  Interleaved 1F1B (torchtitan/parallelisms/pipelining_utils.py), FSDP with pipelines does not reshard after
  forward (parallelize_llama.py apply_fsdp: ZeRO-2's parameter residency), "selective" = its op-level policy
  (config default `selective_ac_option = 'op'`, modelled as the planner's selective).
  torch.compile (every Float8 row) is not modelled: the planner prices eager kernels.
- MosaicML LLM Foundry's MPT benchmark tables (github.com/mosaicml/llm-foundry, scripts/train/benchmarking/
  README.md, commit 8c8dd48): every knob published per row - GPUs, sequence, micro-batch, gradient accumulation,
  FSDP sharding (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2), activation checkpointing (True = every block:
  full; False = none), precision - and "Throughput (T/s/GPU)". Models: scripts/train/yamls/pretrain/mpt-*.yaml
  (d_model, n_heads, n_layers, expansion 4, vocabulary 50,368), with MPT's defaults (learned positions, biases,
  LayerNorm, GELU, tied embeddings: the table's NumParams, e.g. 6,658,859,008 for 7b at 2,048, is exactly that
  count) and flash attention (`attn_impl: flash`). Rows taken by a rule fixed before any was predicted: the
  "H100 80GB BF16 (Large Scale)" table's every model at 512 GPUs; the "H100 80GB FP8" table's row at 2,048
  tokens; the "A100 80GB" table's (200 Gb/s per GPU: "1600 Gbps node-node interconnect") every model from 1B up
  at 2,048 tokens on the most GPUs it lists for that model. The H100 tables do not name their network: the
  h100-80gb preset's 400 Gb/s.
"""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.hardware import GiB, PRESETS

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]
# torchtitan's Grand Teton H100: 96 GB HBM2e at 2.4 TB/s, the SXM's peak (see above), 400 Gb/s per GPU (NDR's)
GRAND_TETON = replace(H100, name="h100-96gb (Grand Teton, 500 W)", memory_bytes=96 * GiB, hbm_bytes_per_s=2.4e12)


def _model(preset, **changes):
    return replace(load_config(None, [f"model.preset={preset}"]).model, **changes)


LLAMA31_8B = _model("llama-7b", vocab=128256, max_seq=8192, kv_heads=8, ffn_hidden=14336)
LLAMA31_8B_32K = replace(LLAMA31_8B, max_seq=32768)
LLAMA31_70B = _model("llama-70b", vocab=128256, max_seq=8192)
LLAMA31_405B = _model("llama-405b")


def mpt(d_model, n_heads, n_layers):
    """An MPT of llm-foundry's yamls: GPT-style blocks with biases, learned positions, tied embeddings."""
    return _model("gpt3-175b", hidden=d_model, heads=n_heads, kv_heads=n_heads, layers=n_layers,
                  ffn_hidden=4 * d_model, vocab=50368, vocab_multiple=1, max_seq=2048)


MPT = {"1b": mpt(2048, 16, 24), "3b": mpt(2560, 20, 32), "7b": mpt(4096, 32, 32), "13b": mpt(5120, 40, 40),
       "30b": mpt(7168, 56, 48), "70b": mpt(8192, 64, 80)}

TITAN = "torchtitan 2024-12"
# (id, model, gpu, GPUs, global batch, seq, published knobs, metric, published value, known miss or None);
# metric "tokens_per_gpu": tokens/s per GPU, compared as throughput. Known misses are filled in below.
NEW_RUNS = [
    # table 1: 8 GPUs, local batch 2, global 16, selective AC
    (f"{TITAN} Llama 3.1 8B, 8 H100, FSDP", LLAMA31_8B, GRAND_TETON, 8, 16, 8192,
     dict(tp=1, pp=1, zero=3, remat="selective", micro_batch=2), "tokens_per_gpu", 5762, None),
    (f"{TITAN} Llama 3.1 8B, 8 H100, FSDP + compile + Float8", LLAMA31_8B, GRAND_TETON, 8, 16, 8192,
     dict(tp=1, pp=1, zero=3, remat="selective", micro_batch=2, precision="fp8"), "tokens_per_gpu", 8532, None),
    # table 2, its CP 1 row: 8 GPUs, local batch 1, full AC, sequence 32,768
    (f"{TITAN} Llama 3.1 8B, 8 H100, seq 32768, FSDP + compile + Float8", LLAMA31_8B_32K, GRAND_TETON, 8, 8, 32768,
     dict(tp=1, pp=1, zero=3, remat="full", micro_batch=1, precision="fp8"), "tokens_per_gpu", 3890, None),
    # table 3: 128 GPUs, local batch 2, global 256, selective AC
    (f"{TITAN} Llama 3.1 8B, 128 H100, FSDP", LLAMA31_8B, GRAND_TETON, 128, 256, 8192,
     dict(tp=1, pp=1, zero=3, remat="selective", micro_batch=2), "tokens_per_gpu", 5605, None),
    (f"{TITAN} Llama 3.1 8B, 128 H100, FSDP + compile + Float8", LLAMA31_8B, GRAND_TETON, 128, 256, 8192,
     dict(tp=1, pp=1, zero=3, remat="selective", micro_batch=2, precision="fp8"), "tokens_per_gpu", 8380, None),
    # table 4: 256 GPUs (FSDP 32, TP 8), local batch 16, global 512, full AC, Float8 + compile (the "2D" row)
    (f"{TITAN} Llama 3.1 70B, 256 H100, FSDP 32 TP 8", LLAMA31_70B, GRAND_TETON, 256, 512, 8192,
     dict(tp=8, pp=1, zero=3, remat="full", micro_batch=16, precision="fp8"), "tokens_per_gpu", 829, None),
    # table 5: 512 GPUs (FSDP 8, TP 8, PP 8), local batch 32, global 256, full AC, Float8 + compile + AsyncTP;
    # 8 pipeline micro-batches (the pp degree: 4 sequences each), FSDP kept gathered over them (ZeRO-2)
    (f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, 1F1B", LLAMA31_405B, GRAND_TETON, 512, 256, 8192,
     dict(tp=8, pp=8, zero=2, remat="full", micro_batch=4, schedule="1f1b", precision="fp8"), "tokens_per_gpu", 100,
     None),
    (f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, Interleaved 1F1B", LLAMA31_405B, GRAND_TETON, 512, 256,
     8192, dict(tp=8, pp=8, zero=2, remat="full", micro_batch=4, schedule="interleaved", virtual_stages=2,
                precision="fp8"), "tokens_per_gpu", 128, None),
]
# llm-foundry: (model, GPUs, micro-batch, accumulation, sharding, checkpointing, T/s/GPU) as the tables print them
_H100_LARGE = [("70b", 512, 8, 1, 3, True, 1007), ("30b", 512, 8, 1, 3, True, 2115), ("13b", 512, 16, 1, 3, True, 4952),
               ("7b", 512, 6, 1, 3, False, 9670), ("3b", 512, 8, 1, 2, False, 21664),
               ("1b", 512, 12, 1, 2, False, 39837)]
_H100_FP8 = [("3b", 8, 10, 6, 3, False, 30586)]
_A100_80 = [("70b", 64, 8, 4, 3, True, 410), ("30b", 8, 3, 21, 3, True, 916), ("13b", 8, 2, 3, 3, False, 2262),
            ("7b", 8, 6, 2, 3, False, 4641), ("3b", 8, 10, 2, 3, False, 10811), ("1b", 8, 14, 4, 3, False, 20513)]
for table, gpu, precision, label in ((_H100_LARGE, H100, "bf16", "H100"), (_H100_FP8, H100, "fp8", "H100 FP8"),
                                     (_A100_80, A100, "bf16", "A100")):
    for size, gpus, micro, accum, zero, ckpt, tps in table:
        NEW_RUNS.append((f"MPT {size}, {gpus} {label}", MPT[size], gpu, gpus, micro * accum * gpus, 2048,
                         dict(tp=1, pp=1, zero=zero, remat="full" if ckpt else "none", micro_batch=micro,
                              **({"precision": precision} if precision != "bf16" else {})),
                         "tokens_per_gpu", tps, None))

# llm-foundry's attention kernel per row (the model's attn_config.attn_impl, scripts/train/benchmarking): the A100 and
# H100 FP8 tables' runs (sweep.sh of b2a43a147, llm-foundry v0.3.0; and the A100 table's older bf16 PURE rows) pass no
# --attn_impl, so submit_benchmarks.py's default `triton` ran - llm-foundry's Triton FlashAttention
# (llmfoundry/models/layers/flash_attn_triton.py, copied from the flash-attn repository's); the large-scale table's
# sweep.py (5e85bd62d) passes `--attn_impl flash` (flash-attn 2.4.2, the `gpu-flash2` extra) for 1b, 3b, 7b and 70b
# and `--attn_impl triton` for 13b and 30b. The kernels' published rates: planner/kernel_data.py
TRITON_ATTENTION = tuple(run[0] for run in NEW_RUNS if run[0].startswith("MPT") and (
    run[2].name.startswith("a100") or run[0].endswith("FP8") or run[0].startswith(("MPT 13b, 512", "MPT 30b, 512"))))

# The rows that miss 15%, with the error the table prints (`known_miss`: test_planner_validation.verdict holds each
# within 2 points, so a miss that grows or shrinks fails) and where the gap lies as far as the data shows it
# (docs/planner.md, "Validation set": the added rows). The step's exposed communication share is printed by
# `python -m tests.unit.test_planner_validation` beside each row.
_EAGER = ("compute: the eager block's passes over HBM are priced (planner/compute.py torchtitan-eager: 3.3x the fused "
          "bytes), which took 24-26 points off; what remains is not priced: the 500 W power cap (the peak taken as the "
          "SXM's, the source does not know it) and the elementwise work op-level checkpointing redoes in the backward")
_FP8 = "compute: fp8 casts and the compiled graph not priced (kernel tables are bf16)"
_HIDDEN = ("exposed communication: the model hides FSDP's per-block gathers and reduce-scatters over 512 ranks (NCCL's "
           "rings through each node's 8 NICs) behind compute, slowed by the published overlap_slowdown; exposed in full, "
           "every MPT row at 512 H100 is within 8% (tests/unit/test_planner_dp_sync.py; their gradients reduced in fp32, "
           "Workload.grad_reduce). What else keeps llm-foundry's "
           "FSDP from overlapping there is not modelled")
_BUBBLE = ("not found: the model prices the schedule's bubble ((p - 1) / (v m) = 44% of a rank's compute at p 8, v 2, "
           "m 8) and FSDP2's once-a-step fp32 reduce-scatter behind the last backward; +14.5% before that reduce-scatter "
           "was priced as FSDP2 runs it under a pipeline (it was m bf16 ones, planner/dp_comm.py)")
KNOWN_MISSES = {
    f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, Interleaved 1F1B": (0.158, _BUBBLE),
    f"{TITAN} Llama 3.1 8B, 8 H100, FSDP": (0.279, _EAGER),
    f"{TITAN} Llama 3.1 8B, 8 H100, seq 32768, FSDP + compile + Float8": (0.261, _FP8 + "; 32k keys beyond the 16k "
                                                                                     "of the attention table"),
    f"{TITAN} Llama 3.1 8B, 128 H100, FSDP": (0.312, _EAGER),
    "MPT 7b, 512 H100": (0.322, _HIDDEN),
    "MPT 3b, 512 H100": (0.336, _HIDDEN),
    "MPT 1b, 512 H100": (0.379, _HIDDEN),
}
NEW_RUNS = [(*run[:9], KNOWN_MISSES.get(run[0], (None,))[0]) for run in NEW_RUNS]

# measured peak memory per GPU, GiB, where the source publishes it (torchtitan's "Memory(GiB)")
MEASURED_PEAK_GIB = {
    f"{TITAN} Llama 3.1 8B, 8 H100, FSDP": 82.4,
    f"{TITAN} Llama 3.1 8B, 8 H100, FSDP + compile + Float8": 76.8,
    f"{TITAN} Llama 3.1 8B, 8 H100, seq 32768, FSDP + compile + Float8": 83.9,
    f"{TITAN} Llama 3.1 8B, 128 H100, FSDP": 67.0,
    f"{TITAN} Llama 3.1 8B, 128 H100, FSDP + compile + Float8": 61.8,
    f"{TITAN} Llama 3.1 70B, 256 H100, FSDP 32 TP 8": 71.9,
    f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, 1F1B": 82.5,
    f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, Interleaved 1F1B": 72.7,
}

# Measured peaks the planner does not model, left out of the memory check: the compiled Float8 rows with torchtitan's
# op-level selective policy (torch.compile's partitioner may keep what the policy marks PREFER_RECOMPUTE; the
# planner counts what the eager policy keeps: 59.5 and 44.1 GiB against 76.8 and 61.8)
COMPILED_SELECTIVE = (f"{TITAN} Llama 3.1 8B, 8 H100, FSDP + compile + Float8",
                      f"{TITAN} Llama 3.1 8B, 128 H100, FSDP + compile + Float8")
# measured peaks the planner misses by more than 10%, with the error (predicted / measured - 1) the check pins
# within 2 points: the 70B's all-gathered, tp-sharded logits and Float8 weight casts, and torch.distributed.pipelining's
# 1F1B holding more than its schedule's activations (the same model's interleaved row is within 2%), are not modelled
MEMORY_MISSES = {f"{TITAN} Llama 3.1 70B, 256 H100, FSDP 32 TP 8": -0.115,
                 f"{TITAN} Llama 3.1 405B, 512 H100, FSDP 8 TP 8 PP 8, 1F1B": -0.159}
MEMORY_WITHIN = 0.10

NEW_SOURCES = {
    TITAN: "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (tables 1-5; configs of commit 9dec370)",
    "MPT": "MosaicML llm-foundry scripts/train/benchmarking/README.md (commit 8c8dd48): H100 80GB BF16 (Large "
           "Scale), H100 80GB FP8 and A100 80GB tables",
}


def test_torchtitan_op_selective_keeps_what_its_policy_saves():
    """Per block, b = 2 sequences of 8,192 tokens of Llama 3.1 8B in bf16: the block's input, wq's, wv's, w1's and
    w2's outputs, SDPA's output and fp32 log-sum-exp (written out from torchtitan's `_save_list`); under Float8
    the linears' outputs are not aten.mm's and none is kept. threefold's own selective keeps far more."""
    from threefold.planner.activations import Shape, block_bytes

    x, tokens, h = Shape(2, 8192, 2), 2 * 8192, 4096
    lse = 4 * 2 * 32 * 8192
    kept = 2 * tokens * (h + h + 1024 + h + 14336 + h) + lse
    assert block_bytes(LLAMA31_8B, x, "op") == kept
    assert block_bytes(LLAMA31_8B, x, "op-fp8") == 2 * tokens * (h + h) + lse
    assert block_bytes(LLAMA31_8B, x, "selective") > 1.5 * kept


def test_the_added_rows_are_ten_or_more_each_with_its_source():
    from tests.unit.test_planner_validation import VALIDATION, source

    names = {run[0] for run in VALIDATION}
    assert len(NEW_RUNS) >= 10 and all(run[0] in names for run in NEW_RUNS)
    assert all(source(run[0]) in NEW_SOURCES.values() for run in NEW_RUNS)
    assert set(KNOWN_MISSES) <= {run[0] for run in NEW_RUNS} and set(MEASURED_PEAK_GIB) <= {run[0] for run in NEW_RUNS}


MEMORY_ROWS = [run for run in NEW_RUNS if run[0] in MEASURED_PEAK_GIB and run[0] not in COMPILED_SELECTIVE]


@pytest.mark.parametrize("run", MEMORY_ROWS, ids=[r[0] for r in MEMORY_ROWS])
def test_measured_peak_memory_within_10_percent(run):
    """The published layout's predicted peak (the rank that needs the most) against torchtitan's measured
    max_reserved: within 10%, or its documented miss within 2 points (a miss that shrinks fails too)."""
    from tests.unit.test_planner_validation import KNOWN_MISS_BAND, predict

    _, best = predict(run)
    err = best.memory.total / GiB / MEASURED_PEAK_GIB[run[0]] - 1
    miss = MEMORY_MISSES.get(run[0])
    if miss is None:
        assert abs(err) <= MEMORY_WITHIN, f"{run[0]}: predicted {best.memory.total / GiB:.1f} GiB, {err:+.1%}"
    else:
        assert abs(err - miss) <= KNOWN_MISS_BAND, f"{run[0]}: {err:+.1%} against the documented {miss:+.1%}"


def test_torchtitan_op_selective_redoes_the_matmuls_it_does_not_keep():
    """wk, wo and w3 of Llama 3.1 8B per token (2 FLOPs a multiply-add), every linear under Float8."""
    from threefold.planner.compute import recomputed_forward_flops_per_token

    h, kv, f, layers = 4096, 1024, 14336, 32
    redone = 2 * (h * kv + h * h + h * f)
    assert recomputed_forward_flops_per_token(LLAMA31_8B, 8192, "op", layers) == layers * redone
    every = 2 * (h * h + 2 * h * kv + h * h + 3 * h * f)
    assert recomputed_forward_flops_per_token(LLAMA31_8B, 8192, "op-fp8", layers) == layers * every
