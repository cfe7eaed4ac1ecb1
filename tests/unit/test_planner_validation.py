"""The planner on published large runs it was NOT calibrated on (docs/planner.md, "Validation").

Calibration: `compute_efficiency` per GPU kind was set from Narayanan et al. 2021 (tables 1-2,
tests in test_planner_model.py). Validation: the runs below, from other papers and other
software, kept here as data. Each run fixes what its source publishes (GPUs, layout, batch,
sequence, recomputation, ZeRO stage, schedule family); what the source does not state (micro-batch
size, interleaving depth) is chosen by the planner. Nothing here was used to set a constant; a
row that misses 15% is recorded with its error (see `known_miss`), not tuned away.
"""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.hardware import PRESETS
from threefold.planner.search import search
from threefold.planner.step_time import hardware_tflops_per_gpu
from threefold.planner.workload import Workload

A100, H100 = PRESETS["a100-80gb"], PRESETS["h100-80gb"]
# BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per 8 GPUs, i.e. 50 Gb/s per GPU
JEAN_ZAY = replace(A100, name="a100-80gb (Jean Zay)", inter_bytes_per_s=50e9 / 8, infiniband="omni-path")


def model(preset, **changes):
    return replace(load_config(None, [f"model.preset={preset}"]).model, **changes)


def gpt(hidden, heads, layers, vocab, **changes):
    return model("gpt3-175b", hidden=hidden, heads=heads, kv_heads=heads, layers=layers, ffn_hidden=4 * hidden,
                 vocab=vocab, max_seq=2048, **changes)


MTNLG = gpt(20480, 128, 105, 51200)
LLAMA3_70B = model("llama-70b", vocab=128256, max_seq=8192)
LLAMA3_8B = model("llama-7b", vocab=128256, max_seq=8192, kv_heads=8, ffn_hidden=14336)

# (id, model, gpu, GPUs, global batch, seq, published knobs, metric, published value, known miss or None)
RUNS = [
    ("MT-NLG 530B, 2240 A100", MTNLG, A100, 2240, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 126, None),
    ("MT-NLG 530B, 2800 A100", MTNLG, A100, 2800, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 121, None),
    ("MT-NLG 530B, 3360 A100", MTNLG, A100, 3360, 1920, 2048, dict(tp=8, pp=35, remat="full", schedule="1f1b"),
     "tflops", 113, None),
    ("BLOOM 176B, 384 A100", gpt(14336, 112, 70, 250880, position="rope"), JEAN_ZAY, 384, 2048, 2048,
     dict(tp=4, pp=12, zero=1, remat="full", schedule="1f1b"), "tflops", 150, None),
    ("OPT 175B, 992 A100", gpt(12288, 96, 96, 50272), A100, 992, 992, 2048, dict(tp=8, pp=1, zero=3, remat="full"),
     "tflops", 147, None),
    ("Llama 3 405B, 8192 H100", model("llama-405b"), H100, 8192, 2048, 8192,
     dict(tp=8, pp=16, schedule="interleaved"), "tflops", 430, None),
    ("Llama 3 405B, 16384 H100", model("llama-405b"), H100, 16384, 2048, 8192,
     dict(tp=8, pp=16, schedule="interleaved"), "tflops", 400, None),
    ("torchtitan Llama 3 70B, 64 A100", LLAMA3_70B, A100, 64, 64, 8192, dict(tp=1, pp=1, zero=3, remat="full"),
     "mfu", 0.517, None),
    ("torchtitan Llama 3 8B, 64 A100", LLAMA3_8B, A100, 64, 64, 8192, dict(tp=1, pp=1, zero=3, remat="selective"),
     "mfu", 0.568, None),
]


# software of 2021-2022 (Megatron-LM/DeepSpeed, metaseq): the attention kernel computed the whole s x s
# scores; Llama 3 and torchtitan ran fused causal (flash) kernels, as threefold does
DENSE_ATTENTION = ("MT-NLG", "BLOOM", "OPT")
# Megatron-LM / DeepSpeed pipelines of 2021-22 reduced gradients after the pipeline flush (DeepSpeed's
# TrainSchedule: ReduceGrads after the last micro-batch); metaseq's FSDP (OPT) overlapped, as torchtitan does
AFTER_FLUSH = ("MT-NLG", "BLOOM")
# DeepSpeed's PipelineEngine ran MT-NLG's and BLOOM's pipelines (Megatron-DeepSpeed): blocking sends and
# receives one after the other, tensors partitioned over tp and gathered back (planner/pipeline_p2p.py)
DEEPSPEED_PIPELINE = ("MT-NLG", "BLOOM")


def workload(name, m, batch, seq):
    return Workload(m, batch, seq, attention="dense" if name.startswith(DENSE_ATTENTION) else "flash",
                    grad_overlap=not name.startswith(AFTER_FLUSH),
                    pipeline_p2p="deepspeed" if name.startswith(DEEPSPEED_PIPELINE) else "batched")


def predict(run):
    """(predicted value, the candidate) for the published layout, unpublished knobs searched."""
    name, m, gpu, gpus, batch, seq, knobs, metric, _, _ = run
    w = workload(name, m, batch, seq)
    best = None
    for v in ((2, 4, 8) if knobs.get("schedule") == "interleaved" else (1,)):
        fixed = dict(knobs, **({"virtual_stages": v} if v > 1 else {}))
        r = search(w, gpus, replace(gpu, memory_bytes=1 << 50), fixed)  # throughput only: see the doc on memory
        for c in r.candidates:
            if best is None or c.tokens_per_s > best.tokens_per_s:
                best = c
    value = hardware_tflops_per_gpu(w, best.strategy, best.time.total_s) if metric == "tflops" else best.mfu
    return value, best


@pytest.mark.parametrize("run", RUNS, ids=[r[0] for r in RUNS])
def test_validation_runs_within_15_percent(run):
    name, *_, published, known_miss = run
    value, best = predict(run)
    err = value / published - 1
    if known_miss is None:
        assert abs(err) <= 0.15, f"{name}: predicted {value:.3g} vs published {published} ({err:+.1%})"
    else:  # documented miss: the doc's figure must stay true
        assert err == pytest.approx(known_miss, abs=0.02), f"{name}: {err:+.1%}, the doc says {known_miss:+.1%}"


if __name__ == "__main__":  # the table of docs/planner.md: python -m tests.unit.test_planner_validation
    for run in RUNS:
        name, m, gpu, gpus, batch, seq, knobs, metric, published, _ = run
        value, chosen = predict(run)
        free = search(workload(name, m, batch, seq), gpus, gpu)
        gain = f"{free.best.tokens_per_s / chosen.tokens_per_s - 1:+.0%} ({free.best.strategy.label()})" \
            if free.feasible else "nothing fits"
        print(f"| {name} | {chosen.strategy.label()} | {published} | {value:.3g} | {value / published - 1:+.1%} | "
              f"{gain} |")
