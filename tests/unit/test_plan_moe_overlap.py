"""The expert all-to-all hidden behind the paired chunk's compute (planner/moe.py, docs/planner.md
"Mixtures of experts"), and DeepSeek-V3's published step as a validation row (not used to set any
constant: the overlap rule has no fitted term)."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.hardware import PRESETS
from threefold.planner.moe import overlapped_all_to_all, overlapped_pairs
from threefold.planner.search import search
from threefold.planner.workload import Workload


def test_schedules_without_pairs_hide_nothing():
    for schedule in ("1f1b", "interleaved", "zb-h1", "zb-v", "gpipe"):
        assert overlapped_pairs(schedule, 4, 8, 0) == 0
        assert overlapped_all_to_all(schedule, 4, 8, 0, 1.0, 2.0, 0.5, 1.0) == (0.5, 1.0, 0.0)


def test_dualpipev_hides_the_paired_share_only():
    p, m = 4, 8
    for rank in range(p):
        pairs = overlapped_pairs("dualpipev", p, m, rank)
        assert 0 < pairs < 2 * m  # warm-up and cool-down run unpaired
        # compute far longer than the all-to-all: the pairs hide all of theirs, the rest stays
        f, b, hidden = overlapped_all_to_all("dualpipev", p, m, rank, 10.0, 20.0, 0.1, 0.2)
        assert hidden == pytest.approx(pairs * 0.3 / 2 / m)
        assert f + b == pytest.approx(0.3 * (1 - pairs / (2 * m)))
        assert f / b == pytest.approx(0.5)
        # all-to-all far longer than the compute: a pair hides only as much as it computes
        f, b, hidden = overlapped_all_to_all("dualpipev", p, m, rank, 0.1, 0.2, 10.0, 20.0)
        assert hidden == pytest.approx(pairs * 0.3 / 2 / m) and f + b == pytest.approx(30.0 - hidden)


# DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437):
# - section 3.1: 2,048 H800 GPUs, 8 per node on NVLink/NVSwitch, InfiniBand across nodes (the h800-80gb
#   preset: one 400 Gb/s NIC per GPU, "IB (50 GB/s)" in section 3.2.2)
# - section 3.2: "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP) spanning 8 nodes, and
#   ZeRO-1 Data Parallelism (DP)", no tensor parallelism; DualPipe, whose pairs overlap the all-to-all
#   with the other chunk's compute (section 3.2.1) - here dualpipev, its V-shaped fold
# - section 4.2: sequence length 4K, batch 15,360 sequences after the first 469B tokens
# - section 1 / table 1: "each trillion tokens requires only 180K H800 GPU hours, i.e., 3.7 days on our
#   cluster with 2048 H800 GPUs": 15,360 x 4,096 tokens per step at 1e12 / (180e3 x 3600 / 2048) tokens/s
GPUS, BATCH, SEQ = 2048, 15360, 4096
PUBLISHED_STEP_S = BATCH * SEQ * 180e3 * 3600 / GPUS / 1e12  # 19.9 s
LAYOUT = dict(tp=1, pp=16, ep=64, zero=1, schedule="dualpipev")  # micro-batches, recomputation searched
# The row still misses (recorded, not tuned away): predicted 38.1 s against 19.9 s, +92% (without the overlap
# 50.3 s, +153%; 36.8 s, +85%, before the H800 preset took the H100's published kernel tables - SDPA's
# FlashAttention-2 rates and a fixed cost per GEMM, planner/kernel_data.py; DeepSeek's own attention kernel is
# not published; 35.8 s, +80%, before each pair's sides were priced apart:
# max(0, a2a(F) - compute(B)) + max(0, a2a(B) - compute(F)) in place of one sum over the pair). What the planner leaves out of DeepSeek's run: FP8 GEMMs (twice the
# BF16 peak it charges), node-limited routing (each token to at most 4 nodes, its IB bytes sent once per
# node and forwarded over NVLink) and FP8 dispatch (section 3.2.2, 3.3), and selective recomputation of
# RMSNorm and MLA's up-projections only (the planner recomputes whole blocks to fit: without recomputation
# the same layout would take 24.4 s, +22%, but needs 210 GiB per GPU in threefold's activations).
KNOWN_MISS = 0.92


def deepseek_step(overlap: bool):
    m = load_config(None, ["model.preset=deepseek-v3"]).model
    r = search(Workload(m, BATCH, SEQ, a2a_overlap=overlap), GPUS, PRESETS["h800-80gb"], LAYOUT)
    c = r.candidates[0]
    assert c.fits, c.why  # the published layout fits the real 80 GB preset
    return c


def test_deepseek_v3_step_with_the_all_to_all_overlapped():
    plain, overlapped = deepseek_step(False), deepseek_step(True)
    assert plain.time.ep_overlapped_s == 0.0 and overlapped.time.ep_overlapped_s > 0
    assert overlapped.time.ep_comm_s < plain.time.ep_comm_s
    error_plain = plain.time.total_s / PUBLISHED_STEP_S - 1
    error = overlapped.time.total_s / PUBLISHED_STEP_S - 1
    print(f"\n  DeepSeek-V3 on 2048 H800: published {PUBLISHED_STEP_S:.1f} s per step, predicted "
          f"{overlapped.time.total_s:.1f} s ({error:+.0%}; without the overlap {plain.time.total_s:.1f} s, "
          f"{error_plain:+.0%}), all-to-all exposed {overlapped.time.ep_comm_s:.1f} s, hidden "
          f"{overlapped.time.ep_overlapped_s:.1f} s ({overlapped.strategy.label()})")
    assert abs(error) < abs(error_plain)
    assert error <= KNOWN_MISS + 0.05, "the row got worse than recorded"


def test_the_default_plan_hides_what_threefolds_runtime_hides():
    """By default (`a2a_overlap=None`) the plan overlaps a dualpipev pair's all-to-all where threefold's runtime
    does (pipeline/expert_overlap.py: ep > 1, no tp, ZeRO-3 or recomputation) and hides nothing where it does
    not; a software that never overlaps (`a2a_overlap=False`) hides nothing."""
    m = replace(load_config(None, ["model.preset=tiny-moe"]).model, layers=4)
    w = Workload(m, 16, 64)
    fixed = dict(tp=1, pp=2, ep=2, zero=1, schedule="dualpipev", microbatches=4, remat="none")
    default, never = (search(x, 8, PRESETS["h100-80gb"], fixed).candidates[0] for x in (w, replace(w, a2a_overlap=False)))
    assert default.time.ep_overlapped_s > 0 and never.time.ep_overlapped_s == 0.0
    assert default.time.ep_comm_s < never.time.ep_comm_s
    blocked = search(w, 8, PRESETS["h100-80gb"], {**fixed, "zero": 3}).candidates[0]  # ZeRO-3 keeps the sides apart
    assert blocked.time.ep_overlapped_s == 0.0
