"""The planner on published large runs it was NOT calibrated on (docs/planner.md, "Validation set").

Calibration set: Narayanan et al. 2021, tables 1-2 (A100, Megatron-LM of 2021; test_planner_model.py):
the one fitted constant, `Gpu.compute_efficiency`, was set there (the mean error of that table is 0).
The GEMM model's other numbers are published kernel measurements (planner/hardware.py).
Validation set: the runs below, from other papers, other software and other GPUs, disjoint from the
calibration set, kept here as data. Each run fixes what its source publishes (GPUs, layout, batch,
sequence, recomputation, ZeRO stage, schedule family, micro-batch size); what the source does not state
is chosen by the planner, on the real 80 GB preset: the published layout must be predicted to fit.
Nothing here was used to set a constant; a row that misses 15% is recorded with its error (see
`known_miss`), not tuned away.
"""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.dp_comm import software_bucket_mb
from threefold.planner.hardware import PRESETS
from threefold.planner.search import search
from threefold.planner.step_time import hardware_tflops_per_gpu
from threefold.planner.workload import Workload
from tests.unit.test_planner_published import NEW_RUNS, NEW_SOURCES, TRITON_ATTENTION

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]
# BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per 8 GPUs, i.e. 50 Gb/s per GPU
JEAN_ZAY = replace(A100, name="a100-80gb (Jean Zay)", inter_bytes_per_s=50e9 / 8, infiniband="omni-path")


def model(preset, **changes):
    return replace(load_config(None, [f"model.preset={preset}"]).model, **changes)


def gpt(hidden, heads, layers, vocab, **changes):
    return model("gpt3-175b", **dict(dict(hidden=hidden, heads=heads, kv_heads=heads, layers=layers,
                                          ffn_hidden=4 * hidden, vocab=vocab, max_seq=2048), **changes))


MTNLG = gpt(20480, 128, 105, 51200)


def mcore(hidden, heads, layers):
    """Megatron-Core's weak-scaling GPTs: vocabulary 131,072, sequence 4,096, MLP 4h (the README's counts:
    12 l h^2 + 2 V h = 1.74B for h = 2048, l = 24 and 461B for h = 18432, l = 112)."""
    return gpt(hidden, heads, layers, 131072, max_seq=4096, tie_embeddings=False)


# NVIDIA 2024, "Nemotron-4 340B Technical Report" (arXiv 2406.11704), table 1 and section 2: 96 layers,
# hidden 18,432, 96 heads with 8 KV heads (GQA), MLP 73,728 with squared ReLU (two matrices, as GELU's),
# RoPE, no bias, untied embeddings, vocabulary 256,000, sequence 4,096
NEMOTRON4 = model("llama-405b", layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, mlp="gelu",
                  vocab=256000, max_seq=4096)
LLAMA3_70B = model("llama-70b", vocab=128256, max_seq=8192)
LLAMA3_405B_128K = model("llama-405b", max_seq=131072)
LLAMA3_8B = model("llama-7b", vocab=128256, max_seq=8192, kv_heads=8, ffn_hidden=14336)

# (id, model, gpu, GPUs, global batch, seq, published knobs, metric, published value, known miss or None)
# metric: "tflops" hardware TFLOP/s per GPU (recomputation included), "model_tflops" model TFLOP/s per GPU
# (MFU x 989 on H100), "mfu", "seconds" per step (compared as throughput: published / predicted - 1)
RUNS = [
    ("MT-NLG 530B, 2240 A100", MTNLG, A100, 2240, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 126, 0.248),
    ("MT-NLG 530B, 2800 A100", MTNLG, A100, 2800, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 121, 0.258),
    ("MT-NLG 530B, 3360 A100", MTNLG, A100, 3360, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 113, 0.306),
    ("BLOOM 176B, 384 A100", gpt(14336, 112, 70, 250880, position="rope"), JEAN_ZAY, 384, 2048, 2048,
     dict(tp=4, pp=12, zero=1, remat="full", schedule="1f1b"), "tflops", 150, None),
    ("OPT 175B, 992 A100", gpt(12288, 96, 96, 50272), A100, 992, 992, 2048, dict(tp=8, pp=1, zero=3, remat="full"),
     "tflops", 147, 0.157),
    ("Llama 3 405B, 8192 H100", model("llama-405b"), H100, 8192, 2048, 8192,
     dict(tp=8, pp=16, schedule="interleaved"), "tflops", 430, None),
    ("Llama 3 405B, 16384 H100", model("llama-405b"), H100, 16384, 2048, 8192,
     dict(tp=8, pp=16, schedule="interleaved"), "tflops", 400, None),
    # the same table's long-context row: 131,072-token sequences, tp 8, cp 16, pp 16 (dp 8: 16,384 GPUs / 2048;
    # 16M tokens per batch = 128 sequences), all-gather context parallelism (section 3.3.2), 380 TFLOP/s
    # (38% MFU). Which attention count its TFLOP/s use: see LLAMA3_ROWS below and docs/planner.md
    ("Llama 3 405B, 16384 H100, seq 131072", LLAMA3_405B_128K, H100, 16384, 128, 131072,
     dict(tp=8, pp=16, cp=16, cp_method="allgather", schedule="interleaved"), "tflops", 380, None),
    ("torchtitan Llama 3 70B, 64 A100", LLAMA3_70B, A100, 64, 64, 8192, dict(tp=1, pp=1, zero=3, remat="full"),
     "mfu", 0.517, None),
    ("torchtitan Llama 3 8B, 64 A100", LLAMA3_8B, A100, 64, 64, 8192, dict(tp=1, pp=1, zero=3, remat="selective"),
     "mfu", 0.568, None),

    # Megatron-LM README (github.com/NVIDIA/Megatron-LM, commit d98e8a6, images/model_table.png and "Weak
    # Scaling Results"): Megatron-Core on H100, vocabulary 131,072, sequence 4,096, the table's layout (tp, pp,
    # dp = 48) and batch; per-GPU model TFLOP/s (MFU = that / 989). Recomputation, micro-batch, schedule and
    # ZeRO stage are not stated: the planner's (schedules of Megatron-Core: 1f1b, interleaved).
    ("MCore 1.7B, 48 H100", mcore(2048, 16, 24), H100, 48, 192, 4096, dict(tp=1, pp=1), "model_tflops", 408.8, 0.326),
    ("MCore 7.1B, 96 H100", mcore(4096, 32, 30), H100, 96, 192, 4096, dict(tp=2, pp=1), "model_tflops", 465.9, 0.187),
    ("MCore 16B, 192 H100", mcore(6144, 48, 32), H100, 192, 192, 4096, dict(tp=4, pp=1), "model_tflops", 489.1, None),
    ("MCore 32B, 384 H100", mcore(7168, 56, 48), H100, 384, 192, 4096, dict(tp=8, pp=1), "model_tflops", 459.6, None),
    ("MCore 70B, 768 H100", mcore(8192, 64, 84), H100, 768, 384, 4096, dict(tp=8, pp=2), "model_tflops", 419.7, None),
    ("MCore 119B, 1536 H100", mcore(10240, 80, 92), H100, 1536, 768, 4096, dict(tp=8, pp=4), "model_tflops", 420.5,
     None),
    ("MCore 177B, 2304 H100", mcore(12288, 96, 96), H100, 2304, 1152, 4096, dict(tp=8, pp=6), "model_tflops", 432.8,
     None),
    ("MCore 314B, 3072 H100", mcore(16384, 128, 96), H100, 3072, 1536, 4096, dict(tp=8, pp=8), "model_tflops", 474.4,
     None),
    ("MCore 462B, 6144 H100", mcore(18432, 144, 112), H100, 6144, 3072, 4096, dict(tp=8, pp=16), "model_tflops",
     459.9, None),
    # same README, "Strong Scaling Results" (images/strong_scaling.png): the 177B model, batch 1,152 sequences,
    # 96 to 4,608 H100, MFU 47% -> 42%. The layout is not stated; assumed the weak-scaling table's for 177B
    # (tp 8, pp 6), dp = GPUs / 48.
    ("MCore 177B strong, 96 H100", mcore(12288, 96, 96), H100, 96, 1152, 4096, dict(tp=8, pp=6), "mfu", 0.47, None),
    ("MCore 177B strong, 4608 H100", mcore(12288, 96, 96), H100, 4608, 1152, 4096, dict(tp=8, pp=6), "mfu", 0.42,
     None),
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198):
    # table 3 (layouts, global and micro-batch; A100 80GB, sequence 2,048, vocabulary 51,200) and table 5 (sequence
    # parallelism + selective recomputation: MFU 41.5%, 51.4%, 56.0%, 56.3%), the 530B on 2,240 GPUs (dp 8,
    # batch 2,240) MFU 54.2% from the abstract and section 6.3
    ("Korthikanti 22B, 8 A100", gpt(6144, 64, 48, 51200), A100, 8, 4, 2048,
     dict(tp=8, pp=1, remat="selective", sequence_parallel=True, micro_batch=4), "mfu", 0.415, None),
    ("Korthikanti 175B, 64 A100", gpt(12288, 96, 96, 51200), A100, 64, 64, 2048,
     dict(tp=8, pp=8, remat="selective", sequence_parallel=True, micro_batch=1), "mfu", 0.514, None),
    ("Korthikanti 530B, 280 A100", MTNLG, A100, 280, 280, 2048,
     dict(tp=8, pp=35, remat="selective", sequence_parallel=True, micro_batch=1), "mfu", 0.560, None),
    ("Korthikanti 530B, 2240 A100", MTNLG, A100, 2240, 2240, 2048,
     dict(tp=8, pp=35, remat="selective", sequence_parallel=True, micro_batch=1), "mfu", 0.542, None),
    ("Korthikanti 1T, 512 A100", gpt(25600, 160, 128, 51200), A100, 512, 512, 2048,
     dict(tp=8, pp=64, remat="selective", sequence_parallel=True, micro_batch=1), "mfu", 0.563, None),
    # Nemotron-4 340B Technical Report, section 2.3 and table 2: 6,144 H100 (768 DGX nodes), tp 8, pp 12 with
    # interleaving, dp 64, batch 2,304 x 4,096, 8.0 s per iteration (MFU 41.0%)
    ("Nemotron-4 340B, 6144 H100", NEMOTRON4, H100, 6144, 2304, 4096, dict(tp=8, pp=12, schedule="interleaved"),
     "seconds", 8.0, None),
] + NEW_RUNS  # the rows of tests/unit/test_planner_published.py, each from its source


# software of 2021-2022 (Megatron-LM/DeepSpeed, metaseq): the attention kernel computed the whole s x s
# scores; Llama 3 and torchtitan ran fused causal (flash) kernels, as threefold does
DENSE_ATTENTION = ("MT-NLG", "BLOOM", "OPT", "Korthikanti")
# Megatron-LM / DeepSpeed pipelines of 2021-22 reduced gradients after the pipeline flush (DeepSpeed's
# TrainSchedule: ReduceGrads after the last micro-batch); metaseq's FSDP (OPT) overlapped, as torchtitan does
AFTER_FLUSH = ("MT-NLG", "BLOOM", "Korthikanti")
# DeepSpeed's PipelineEngine ran MT-NLG's and BLOOM's pipelines (Megatron-DeepSpeed): blocking sends and
# receives one after the other, tensors partitioned over tp and gathered back (planner/pipeline_p2p.py)
DEEPSPEED_PIPELINE = ("MT-NLG", "BLOOM")
# Megatron-LM of 2022 split pipeline tensors over tp and gathered them on arrival (as the calibration set)
SCATTER_GATHER = ("Korthikanti",)
# Megatron's own schedules, where the source names none
MEGATRON = ("MCore", "Korthikanti", "Nemotron")
# sequence parallelism appeared with Korthikanti et al. (May 2022): the software of these runs had none
NO_SEQUENCE_PARALLEL = ("MT-NLG", "BLOOM", "OPT")
# whose cross-entropy ran over the logits (planner/compute.py LOSSES): Megatron's vocabulary-parallel one
# (Megatron-LM, Megatron-DeepSpeed, metaseq's model-parallel models), torchtitan's F.cross_entropy of the
# logits in fp32; Meta's own for Llama 3 is not published (threefold's counted)
MEGATRON_LOSS = ("MCore", "Korthikanti", "Nemotron", "MT-NLG", "BLOOM", "OPT")
TORCH_LOSS = ("torchtitan", "MPT")  # llm-foundry's MPT: torch's cross-entropy of the logits
# whose blocks ran their elementwise work as eager PyTorch operations (planner/compute.py `elementwise_bytes_per_token`):
# torchtitan's Llama without torch.compile - its A100 preset (train_configs/llama3_8b.toml: compile = false,
# norm_type = "rmsnorm", the module of fp32 steps) and the 2024-12 bf16 rows (their Float8 twins name compile); the
# others, and torchtitan's compiled rows, ran fused kernels (Megatron's and Transformer Engine's, llm-foundry's low-precision LayerNorm and GELU)
EAGER = ("torchtitan",)
# whose gradients were reduced in fp32 (Workload.grad_reduce): llm-foundry's MPT rows whose table prints MP Mode
# DEFAULT (scripts/train/benchmarking/README.md) - Composer's DEFAULT (v0.16.4 on; llm-foundry pinned >=0.16.4 for
# the A100/FP8 sweep and >=0.17.2 for the large-scale one) sets FSDP's reduce_dtype to torch.float32; its PURE rows
# (MPT 70b on A100) reduce in bf16; and torchtitan's rows: its FSDP2 MixedPrecisionPolicy takes reduce_dtype from
# `training.mixed_precision_reduce`, "float32" by default (parallelize_llama.py, config_manager.py)
FP32_REDUCE = tuple(run[0] for run in RUNS if run[0].startswith("torchtitan") or (
    run[0].startswith("MPT") and run[0] != "MPT 70b, 64 A100"))


def compiled(knobs: dict) -> bool:
    """torchtitan's Float8 rows ran under torch.compile, each of them (tests/unit/test_planner_published.py)."""
    return knobs.get("precision") == "fp8"


# whose ZeRO-2/3 is PyTorch's FSDP as it runs under a pipeline (Workload.sharding "fsdp2": gradients accumulated
# unsharded, one reduce-scatter a step): torchtitan's FSDP2, and Llama 3's FSDP (ZERO_STAGES below)
FSDP_ACCUMULATES = ("torchtitan", "Llama 3")


def workload(name, m, batch, seq, knobs=None):
    p2p = "deepspeed" if name.startswith(DEEPSPEED_PIPELINE) else \
        "scatter-gather" if name.startswith(SCATTER_GATHER) else "batched"
    loss = "megatron" if name.startswith(MEGATRON_LOSS) else "torch" if name.startswith(TORCH_LOSS) else "threefold"
    return Workload(m, batch, seq, attention="dense" if name.startswith(DENSE_ATTENTION) else "flash",
                    grad_overlap=not name.startswith(AFTER_FLUSH), pipeline_p2p=p2p,
                    regather="linear" if name.startswith(MEGATRON) else "region", loss=loss,
                    selective="torchtitan-op" if name.startswith("torchtitan") else "threefold",
                    sharding="fsdp2" if name.startswith(FSDP_ACCUMULATES) else "threefold",
                    elementwise="torchtitan-eager" if name.startswith(EAGER) and not compiled(knobs or {}) else "fused",
                    grad_reduce="fp32" if name in FP32_REDUCE else "compute")


# the ZeRO stages a run's software offered, where it does not say which it used: Megatron-LM's distributed
# optimizer (2022-24) shards the optimizer states only - ZeRO-1 (megatron/training/arguments.py,
# --use-distributed-optimizer; no sharding of gradients or parameters). The Megatron-Core README's runs state it
# by their flags: "--overlap-grad-reduce --overlap-param-gather", and megatron/training/arguments.py refuses
# --overlap-param-gather without --use-distributed-optimizer ("only supported with distributed optimizer"): ZeRO-1
# Llama 3 states its own (Dubey et al. 2024, section 3.3.2): FSDP sharding "optimizer states and gradients", the
# model shards not resharded after forward - ZeRO-2's residency - and, as PyTorch's FSDP under a pipeline does, the
# gradients accumulated over the micro-batches and reduce-scattered once a step (`FSDP_ACCUMULATES`)
ZERO_STAGES = {"MCore": (1,), "Nemotron": (0, 1), "Korthikanti": (0, 1), "Llama 3": (2,)}
# the stages the software offered (the planner's best layout searches them): Megatron's ZeRO-0 and -1, FSDP all
OFFERED_STAGES = {"MCore": (0, 1), "Nemotron": (0, 1), "Korthikanti": (0, 1)}


def software_options(name: str, knobs: dict, schedules: list | None = None, stages: dict | None = None) -> list[dict]:
    """The completions of `knobs` a run's software offered: its schedules (`schedules`, else the one the knobs
    name, else Megatron's 1F1B and interleaved) times its ZeRO stages (`stages`, else the run's, ZERO_STAGES),
    each a dict of fixed knobs for the search."""
    if schedules is None:
        schedules = [knobs["schedule"]] if "schedule" in knobs else \
            (["1f1b", "interleaved"] if name.startswith(MEGATRON) else [None])
    if knobs.get("pp", 0) == 1:
        schedules = [None]
    zeros = [knobs["zero"]] if "zero" in knobs else \
        next((list(v) for k, v in (ZERO_STAGES if stages is None else stages).items() if name.startswith(k)), [None])
    base = {k: v for k, v in knobs.items() if k not in ("schedule", "zero")}
    return [dict(base, **({"schedule": s} if s else {}), **({"zero": z} if z is not None else {}))
            for s in schedules for z in zeros]


# the gradients' collectives by software (each pays its latency, planner/dp_comm.py): Megatron-Core's buckets
# of max(40M, 1M x dp) parameters (megatron/core/distributed/distributed_data_parallel.py, bf16 gradients,
# grad_reduce_in_fp32 off by default); Megatron-LM of 2021-22 reduced its contiguous gradient buffer in one
# collective; DeepSpeed's pipeline engine in buckets of 500M elements (MEMORY_OPT_ALLREDUCE_SIZE); FSDP
# (OPT, torchtitan) per unit, as ZeRO-3 does here; the others threefold's 25 MiB
MCORE_DDP = ("MCore", "Nemotron")
# llm-foundry's FSDP wraps each MPTBlock as a unit (llmfoundry/models/mpt/modeling_mpt.py `_fsdp_wrap_fn`): under
# SHARD_GRAD_OP too, its gradients are reduce-scattered and its parameters gathered one block at a time
FSDP_BLOCK_UNITS = ("MPT",)
ONE_BUFFER = ("Korthikanti",)


def bucket_mb(name: str, dp: int | None, m=None) -> float | None:
    """The run's software's gradient bucket in MiB of bf16 gradients (dp None: the floor), from the planner's
    table of software (planner/dp_comm.py `software_bucket_mb`)."""
    if name.startswith(FSDP_BLOCK_UNITS) and m is not None:
        return 12 * m.hidden**2 * 2 / 2**20  # one block's gradients (its weight matrices)
    if name.startswith(MCORE_DDP):
        return software_bucket_mb("megatron-core", dp or 0)
    if name.startswith(ONE_BUFFER):
        return software_bucket_mb("megatron-2021")
    if name.startswith(DEEPSPEED_PIPELINE):
        return software_bucket_mb("deepspeed-pipe")
    return None


def fixed_knobs(run) -> dict:
    """The published knobs of a run as the search's fixed knobs (a micro-batch size as a micro-batch count)."""
    name, m, gpu, gpus, batch, seq, knobs, *_ = run
    knobs = dict(knobs, **({"sequence_parallel": False} if name.startswith(NO_SEQUENCE_PARALLEL) else {}))
    knobs.setdefault("hpz", False)  # none of these runs kept a secondary ZeRO-3 copy
    bucket = bucket_mb(name, gpus // (knobs["tp"] * knobs["pp"] * knobs.get("cp", 1)), m)
    if bucket is not None:
        knobs["bucket_mb"] = bucket
    micro_batch = knobs.pop("micro_batch", None)
    if micro_batch is not None:
        knobs["microbatches"] = batch // (gpus // (knobs["tp"] * knobs["pp"]) * micro_batch)
    return knobs


# the fused attention kernel each software ran on a GPU with published attention tables (planner/kernel_data.py):
# Megatron-Core (and Nemotron's Megatron) through Transformer Engine's cuDNN fused attention; torchtitan through
# PyTorch's SDPA and llm-foundry's `attn_impl: flash` through the flash-attn 2 package: FlashAttention-2, the presets'
# own; llm-foundry's `attn_impl: triton` its Triton FlashAttention (TRITON_ATTENTION, test_planner_published.py);
# Llama 3's kernel is not published (the preset's)
CUDNN_ATTENTION = ("MCore", "Nemotron")


def software_gpu(name: str, gpu):
    """`gpu` with the attention table of the run's software, where the GPU has published tables."""
    kind = gpu.attention_table.split("/")[0]
    if kind and name.startswith(CUDNN_ATTENTION):
        return replace(gpu, attention_table=kind + "/cudnn")
    if kind and name in TRITON_ATTENTION:
        return replace(gpu, attention_table=kind + "/triton")
    return gpu


def best_of(w, gpus, gpu, options: list[dict]):
    best = None
    for fixed in options:
        fixed = dict(fixed)
        precision = fixed.pop("precision", "bf16")
        for c in search(w, gpus, gpu, fixed, precision).candidates:
            if c.fits and (best is None or c.tokens_per_s > best.tokens_per_s):
                best = c
    return best


_PREDICTED: dict[tuple[str, str], tuple] = {}  # (row, its GPU's repr) -> predict's answer: each searched once


def predict(run, gpu_override=None):
    """(predicted value, the candidate) for the published layout on the real preset (memory included),
    unpublished knobs searched among what the software offered; the candidate is None when nothing of
    the published layout fits."""
    key = (run[0], repr(gpu_override or run[2]))
    if key not in _PREDICTED:
        _PREDICTED[key] = _predict(run, gpu_override)
    return _PREDICTED[key]


def _predict(run, gpu_override):
    name, m, gpu, gpus, batch, seq, knobs, metric, _, _ = run
    gpu = software_gpu(name, gpu_override or gpu)
    w = workload(name, m, batch, seq, knobs)
    best = best_of(w, gpus, gpu, software_options(name, fixed_knobs(run)))
    if best is None:
        return None, None
    value = {"tflops": hardware_tflops_per_gpu(w, best.strategy, best.time.total_s),
             "model_tflops": best.mfu * gpu.peak_flops / 1e12, "mfu": best.mfu, "seconds": best.time.total_s,
             "tokens_per_gpu": best.tokens_per_s / gpus}[metric]
    return value, best


def software_best(run):
    """The planner's best layout of the run's GPUs, batch and sequence among what its software offered
    (its schedules and ZeRO stages, its sequence-parallel rule), every layout knob searched."""
    name, m, gpu, gpus, batch, seq, knobs, *_ = run
    software = {k: v for k, v in fixed_knobs(run).items() if k in ("hpz", "sequence_parallel", "precision")}
    if bucket_mb(name, None) is not None:
        software["bucket_mb"] = bucket_mb(name, None)
    # the family the source names (interleaved 1F1B) and its plain form
    schedules = list(dict.fromkeys([knobs["schedule"], "1f1b"])) if "schedule" in knobs else None
    return best_of(workload(name, m, batch, seq, knobs), gpus, software_gpu(name, gpu),
                   software_options(name, software, schedules, OFFERED_STAGES))


def error(run, value):
    published, metric = run[8], run[7]
    return published / value - 1 if metric == "seconds" else value / published - 1


WITHIN = 0.15  # a row is right when its error is at most this
KNOWN_MISS_BAND = 0.02  # a documented miss holds while its error stays this close to the documented one


def verdict(err: float, known_miss: float | None) -> str:
    """"" when a row's error is as the table says, else why not: a row without a documented miss must be
    within WITHIN; a documented miss must stay within KNOWN_MISS_BAND of it on either side, so a miss that
    grows fails, and so does one that shrinks (the doc's figure is then stale, or the row now passes and
    its miss must be removed)."""
    if known_miss is None:
        return "" if abs(err) <= WITHIN else f"{err:+.1%} is outside +-{WITHIN:.0%}"
    if err > known_miss + KNOWN_MISS_BAND or err < known_miss - KNOWN_MISS_BAND:
        grew = abs(err) > abs(known_miss)
        return (f"{err:+.1%}: the documented miss {known_miss:+.1%} {'grew' if grew else 'shrank'} past its band "
                f"of +-{KNOWN_MISS_BAND:.0%}")
    return ""


def test_a_known_miss_fails_when_it_grows_or_shrinks_past_its_band():
    assert verdict(0.248, 0.248) == "" and verdict(0.26, 0.248) == "" and verdict(0.235, 0.248) == ""
    assert "grew" in verdict(0.30, 0.248) and "shrank" in verdict(0.20, 0.248)
    assert "shrank" in verdict(0.05, 0.248)  # now within 15%: the miss must be taken out of the table
    assert "grew" in verdict(-0.30, -0.248) and "shrank" in verdict(-0.20, -0.248)
    assert verdict(0.149, None) == "" and verdict(-0.151, None) != ""


@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_validation_runs_within_15_percent(run):
    name, *_, published, known_miss = run
    value, best = predict(run)
    assert best is not None, f"{name}: the published layout is predicted not to fit in {run[2].name}"
    why = verdict(error(run, value), known_miss)
    assert not why, f"{name}: predicted {value:.3g} vs published {published}: {why}"


# The two sets, named and disjoint: the calibration set is Narayanan et al. 2021 (test_planner_model.py
# MEGATRON, the source of `Gpu.compute_efficiency`); every validation row names its own source, none of them
# that paper, and none repeats a calibration run (same model shape, GPUs and batch). Korthikanti et al.'s 530B on
# 2,240 GPUs does: it is the calibration's table-2 layout (tp 8, pp 35, batch 2,240) rerun with selective
# recomputation and sequence parallelism, so it stays in the table (and its test) but not in the validation set.
REPEATS_CALIBRATION = ("Korthikanti 530B, 2240 A100",)
CALIBRATION_SOURCE = "Narayanan et al. 2021, SC'21 (arXiv 2104.04473), tables 1-2"
SOURCES = {
    **NEW_SOURCES,  # before "torchtitan": the longer name is looked up first
    "MT-NLG": "Smith et al. 2022, Megatron-Turing NLG 530B (arXiv 2201.11990), section 2.3",
    "BLOOM": "BigScience 2022, BLOOM (arXiv 2211.05100), section 3.4",
    "OPT": "Zhang et al. 2022, OPT (arXiv 2205.01068), section 2.4",
    "Llama 3": "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), table 4",
    "torchtitan": "Liang et al. 2024, TorchTitan (arXiv 2410.06511), tables of Llama 3 on 64 A100",
    "MCore": "NVIDIA Megatron-LM README, commit d98e8a6 (model_table.png, strong_scaling.png)",
    "Korthikanti": "Korthikanti et al. 2022 (arXiv 2205.05198), tables 3 and 5",
    "Nemotron": "NVIDIA 2024, Nemotron-4 340B Technical Report (arXiv 2406.11704), table 2",
}
VALIDATION = [run for run in RUNS if run[0] not in REPEATS_CALIBRATION]


def source(name: str) -> str:
    return next(v for k, v in SOURCES.items() if name.startswith(k))


def test_calibration_and_validation_sets_are_disjoint_and_named():
    from tests.unit.test_planner_model import MEGATRON, gpt as calibration_model

    assert len({r[0] for r in VALIDATION}) == len(VALIDATION)
    assert all(source(r[0]) and "Narayanan" not in source(r[0]) for r in VALIDATION)
    calibration = {(calibration_model(heads, hidden, layers).hidden, layers, gpus, batch)
                   for _, heads, hidden, layers, tp, pp, gpus, batch, *_ in MEGATRON}
    shape = {r[0]: (r[1].hidden, r[1].layers, r[3], r[4]) for r in RUNS}
    assert calibration and not calibration & {shape[r[0]] for r in VALIDATION}
    assert all(shape[name] in calibration for name in REPEATS_CALIBRATION)


# Rows whose source says the published layout came out of its own search of layouts: Dubey et al. 2024,
# section 3.3.2, developed "a memory consumption estimator and a performance-projection tool" to explore
# parallelism configurations for the 405B model (its 8,192-token runs; the 131k run's all-gather cp was chosen
# for its masks, not for speed). The planner's best among the layouts the run's software offered (every layout
# knob searched; its schedule family, ZeRO stages and sequence-parallel rule) must then be within 10% of the
# published layout as the planner prices it.
BEST_FOUND = [run for run in RUNS if run[0] in ("Llama 3 405B, 8192 H100", "Llama 3 405B, 16384 H100")]
# Where the planner's best beats the published layout by more than 10%, with the gain it prints (held within 2
# points, as a known miss): none. At 8,192 GPUs an FSDP-style layout (dp 512, tp 4, pp 4, ZeRO-3) was +15.1% while its
# hidden gathers cost nothing; with the compute they overlap slowed (planner/step_time.py overlap_interference) it was
# +4.2%; since the published layout runs the ZeRO-2 the source states (ZERO_STAGES), the gains are printed by
# `python -m tests.unit.test_planner_validation Llama` (its last column)
BEST_FOUND_MISS: dict[str, float] = {}


@pytest.mark.parametrize("run", BEST_FOUND, ids=[r[0] for r in BEST_FOUND])
def test_a_published_layout_its_source_searched_for_is_within_10_percent_of_the_planners_best(run):
    _, published = predict(run)
    best = software_best(run)
    gain = best.tokens_per_s / published.tokens_per_s - 1
    why = f"{run[0]}: {best.strategy.label()} is {gain:+.1%} faster than {published.strategy.label()}"
    if run[0] in BEST_FOUND_MISS:
        assert abs(gain - BEST_FOUND_MISS[run[0]]) <= KNOWN_MISS_BAND, why
    else:
        assert gain <= 0.10, why


# Which attention count Meta's TFLOP/s use is not published (docs/planner.md): the column counts the whole s x s
# product (4 s h per token and layer, this file's convention and the planner's MFU), while a causal kernel executes
# half of it. At 8,192 tokens attention is 8% of the counted FLOPs, at 131,072 it is 57%. With the flat attention
# share of the peak the 131k row came out 39% fast counted whole and within 1% counted as executed; with the
# published FlashAttention-2 rates (planner/kernel_data.py; 131k keys take its 16k figure) it is within 15% counted
# whole and 25% slow counted as executed. The 8k rows agree under either count (tested); the errors are printed
# from the data (`main`: the "executed" column), not written here.
LLAMA3_ROWS = [run for run in RUNS if run[0].startswith("Llama 3 405B")]


def executed_tflops(run) -> float:
    from threefold.planner.compute import (blocks_forward_flops_per_token, head_forward_flops_per_token,
                                           recomputed_forward_flops_per_token)

    name, m, gpu, gpus, batch, seq, *_ = run
    _, best = predict(run)
    st, share = best.strategy, 0.5  # the causal half of the s x s product
    per_token = (3 * (blocks_forward_flops_per_token(m, seq, m.layers, 0, share) + head_forward_flops_per_token(m))
                 + recomputed_forward_flops_per_token(m, seq, st.remat, m.layers, st.remat_every, share))
    return per_token * batch * seq / (best.time.total_s * st.world_size) / 1e12


LLAMA3_8K = [run for run in LLAMA3_ROWS if run[5] == 8192]


@pytest.mark.parametrize("run", LLAMA3_8K, ids=[r[0] for r in LLAMA3_8K])
def test_llama3_8k_rows_agree_when_attention_is_counted_as_executed(run):
    value = executed_tflops(run)
    assert abs(value / run[8] - 1) <= 0.15, f"{run[0]}: {value:.3g} vs {run[8]}"


@pytest.mark.parametrize("source, stage", [("MCore", 1), ("Llama 3", 2)])
def test_a_zero_stage_the_source_implies_is_not_searched(source, stage):
    """The Megatron-Core README's --overlap-param-gather needs the distributed optimizer: its rows run ZeRO-1 only;
    Llama 3's FSDP shards optimizer states and gradients and keeps the model shards after forward: ZeRO-2, its
    gradients reduce-scattered once a step (FSDP's accumulation under a pipeline)."""
    rows = [run for run in RUNS if run[0].startswith(source)]
    assert rows and all({o.get("zero") for o in software_options(r[0], fixed_knobs(r))} == {stage} for r in rows)
    assert all(workload(*r[:2], *r[4:6]).sharding == ("fsdp2" if stage == 2 else "threefold") for r in rows)


def test_the_docs_tables_are_printed_from_the_data():
    """docs/planner.md's validation tables and counts are tests/planner_table.py's rendering of these rows."""
    from tests.planner_table import docs_block, render

    assert docs_block() == render(), "docs/planner.md: run python -m tests.unit.test_planner_validation --markdown --write-docs"


def test_the_table_takes_a_measured_gpu_kind_for_the_rows_of_its_preset(tmp_path, capsys):
    """`--gpu KIND.toml` (bench/planner_kernels.py --toml: a preset with measured kernel shares) prices the rows
    on that preset with it: written unchanged it gives the table's own figure, with half the GEMM share less."""
    from threefold.planner.hardware import gpu_toml

    run = next(r for r in RUNS if r[0] == "MCore 1.7B, 48 H100")
    for share, path in ((H100.gemm_efficiency, tmp_path / "same.toml"), (H100.gemm_efficiency / 2, tmp_path / "half.toml")):
        path.write_text(gpu_toml(replace(H100, name="h100-80gb measured (test)", gemm_efficiency=share)))
    main(["--gpu", str(tmp_path / "same.toml"), "MCore 1.7B"])
    main(["--gpu", str(tmp_path / "half.toml"), "MCore 1.7B"])
    same, half = (float(line.split("|")[4]) for line in capsys.readouterr().out.splitlines())
    assert same == float(f"{predict(run)[0]:.3g}") and half < 0.8 * same


def main(argv: list[str] | None = None) -> None:
    """The table of docs/planner.md: python -m tests.unit.test_planner_validation [--gpu KIND.toml] [ROW...]"""
    from tests.planner_table import main as table

    table(argv)


if __name__ == "__main__":
    main()
