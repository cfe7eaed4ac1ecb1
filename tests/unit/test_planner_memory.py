"""Planner memory model: ZeRO formulas, parameter counts, activations against saved tensors."""

import pytest
import torch

from threefold.config import load_config
from threefold.models.decoder import build_model, count_parameters
from threefold.config.presets import PRESETS, PUBLISHED_PARAMS
from threefold.observe.memory import SavedTensorMeter
from threefold.planner.hardware import CPU, PRESETS as GPUS
from threefold.planner.memory import (ALLOCATOR_MARGIN, in_flight, korthikanti_layer_bytes, model_state_bytes,
                                      rank_memory, stage_memory)
from threefold.planner.workload import ParamCount, Strategy, Workload, rank_parameters, total_parameters


def model(preset, *overrides):
    return load_config(None, [f"model.preset={preset}", *overrides]).model


@pytest.mark.parametrize("zero,formula", [
    (0, lambda P, N: 16 * P), (1, lambda P, N: 4 * P + 12 * P / N),
    (2, lambda P, N: 2 * P + 14 * P / N), (3, lambda P, N: 16 * P / N)])
def test_model_states_follow_the_zero_formulas(zero, formula):
    P, N = 7_000_000_000, 64
    assert sum(model_state_bytes(ParamCount(P), "bf16", zero, N)) == pytest.approx(formula(P, N), rel=1e-12)
    # fp32 training keeps 16 bytes per parameter too, split 4 + 4 + 8
    assert model_state_bytes(ParamCount(P), "fp32", 0, N) == (4 * P, 4 * P, 8 * P)


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    params, grads, optim = model_state_bytes(ParamCount(100, frozen=10), "fp32", 0, 1)
    assert (params, grads, optim) == (400, 360, 720)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_counts_are_exact_and_match_publications(preset):
    m = model(preset)
    assert total_parameters(m) == count_parameters(m)
    if preset in PUBLISHED_PARAMS:  # GPT-3 175B, Llama 2 7B/70B, Llama 3 405B, GPT-2: within 1%
        assert abs(total_parameters(m) / PUBLISHED_PARAMS[preset] - 1) < 0.01


def test_sharded_parameters_add_up_to_the_model():
    m = model("llama-70b")
    whole = rank_parameters(m, 1, 1, 0).total
    assert whole == total_parameters(m)
    # pipeline stages partition the model; tensor shards split the matrices (norms replicated)
    assert sum(rank_parameters(m, 1, 4, s).total for s in range(4)) == whole
    assert rank_parameters(m, 8, 1, 0).total == pytest.approx(whole / 8, rel=0.001)


def _measured_activations(preset, batch, seq, dtype, *overrides):
    cfg = model(preset, *overrides)
    net = build_model(cfg, 0).to(dtype)
    rows = torch.randint(0, cfg.vocab, (batch, seq + 1))  # inputs and targets share rows, as in training
    meter = SavedTensorMeter(exclude=list(net.parameters()))
    with meter.measure():
        net(rows[:, :-1], rows[:, 1:])
    return cfg, meter.peak


@pytest.mark.parametrize("preset,batch,seq,overrides", [
    ("tiny", 4, 32, ()), ("tiny-llama", 2, 64, ()), ("tiny-llama", 3, 16, ("model.kv_heads=4",)),
    ("small", 2, 48, ()), ("small", 1, 64, ("model.mlp=swiglu", "model.norm=rmsnorm", "model.position=rope")),
    ("tiny", 2, 32, ("model.bias=false", "model.tie_embeddings=false"))])
def test_predicted_activations_equal_the_bytes_autograd_saves(preset, batch, seq, overrides):
    cfg, measured = _measured_activations(preset, batch, seq, torch.float32, *overrides)
    predicted = rank_memory(Workload(cfg, batch, seq), Strategy(precision="fp32")).activations
    assert predicted == measured


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "small"])
def test_bf16_activations_within_two_percent(preset):
    cfg, measured = _measured_activations(preset, 4, 32, torch.bfloat16)
    predicted = rank_memory(Workload(cfg, 4, 32), Strategy(precision="bf16")).activations
    assert abs(predicted / measured - 1) < 0.02


def test_korthikanti_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True, policy="selective") == pytest.approx(34 * sbh / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, policy="full") == 2 * sbh


def test_tensor_and_sequence_parallelism_and_checkpointing_shrink_activations():
    w = Workload(model("llama-7b"), 64, 4096)
    acts = {}
    for name, st in {"plain": Strategy(microbatches=64), "tp": Strategy(tp=8, microbatches=64),
                     "tp+sp": Strategy(tp=8, sequence_parallel=True, microbatches=64),
                     "selective": Strategy(tp=8, sequence_parallel=True, microbatches=64, remat="selective"),
                     "full": Strategy(tp=8, sequence_parallel=True, microbatches=64, remat="full")}.items():
        acts[name] = rank_memory(w, st).activations
    assert acts["plain"] > acts["tp"] > acts["tp+sp"] > acts["selective"] > acts["full"]
    # with sp every item is split over tp, the linears' inputs too: they save the norm output's 1/t
    # shard once per region and all-gather it again in backward (parallel/sequence_region.py SequenceRegion)
    assert acts["tp+sp"] == pytest.approx(acts["plain"] / 8, rel=0.02)
    # full checkpointing keeps one (b, s, h) input per block
    blocks = 32 * 2 * 4096 * 4096 * 2 / 8
    assert acts["full"] - blocks < acts["selective"] / 10


def test_micro_batches_in_flight_per_schedule():
    """Replayed from the runtime's own action lists: 1F1B holds p - r, GPipe m; ZB-H1's deferred weight
    gradients keep p on every rank (the last rank's first r W's wait); interleaved holds chunks of 2(p-1-r) + (v-1)p + 1."""
    assert in_flight(Strategy(pp=1, microbatches=8), 0) == 1
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="1f1b"), 0) == 4
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="1f1b"), 3) == 1
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="gpipe"), 3) == 8
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="zb-h1"), 0) == 4
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="zb-h1"), 3) == 4
    assert in_flight(Strategy(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2), 0) == 2 * 3 + 4 + 1


def test_gpu_prediction_adds_buffers_and_the_stated_margin_cpu_does_not():
    w = Workload(model("llama-7b"), 64, 4096)
    st = Strategy(dp=8, microbatches=8, zero=1)
    cpu, gpu = stage_memory(w, st, 0, CPU), stage_memory(w, st, 0, GPUS["h100-80gb"])
    assert cpu.margin == cpu.buffers == cpu.transient == 0
    assert gpu.buffers > 0 and gpu.transient > 0
    used = gpu.total - gpu.margin
    assert gpu.margin == pytest.approx(ALLOCATOR_MARGIN * used + 2**30)


def _held_by_hand(name, p, m, v, rank):
    """The states after every forward, none dropped, then those no other state dominates."""
    from threefold.schedules import registry as schedules

    counts, states = [0] * schedules.chunks_per_rank(name, v), set()
    for a in schedules.compute_orders(name, p, m, v)[rank]:
        if a.kind == "F":
            counts[a.stage // p] += 1
            states.add(tuple(counts))
        elif a.kind in ("B", "W"):
            counts[a.stage // p] -= 1
    return tuple(sorted((s for s in states if not any(o != s and all(x >= y for x, y in zip(o, s)) for o in states)),
                        reverse=True))


def test_held_states_shortcuts_are_exact():
    """The planner's held states (computed once for all ranks, from the states before each release,
    and from a shorter steady run when the states stop changing with m) equal the plain count over
    the whole schedule, for every registered schedule, including counts past the shortcut's base."""
    from threefold.schedules import registry as schedules
    from threefold.planner.memory import held_states, steady_microbatches

    shortened = 0
    for name in schedules.SCHEDULES:
        for p, v in ((2, 1), (3, 1), (4, 1), (4, 2), (8, 1), (8, 2), (2, 3)):
            for m in (1, 2, 3, 5, 8, 12, 16, 24, 36, 43, 55, 64, 72, 96):
                if schedules.check(name, p, m, v):
                    continue
                shortened += steady_microbatches(name, p, m, v) != m
                for rank in range(p):
                    assert held_states(name, p, m, v, rank) == _held_by_hand(name, p, m, v, rank), (name, p, m, v, rank)
    assert shortened > 50  # the shortcut is exercised, not only the plain path
