"""Compression pieces that need no world: sign packing, DGC schedule, PowerSGD layout, hook choice, config."""

import pytest
import torch
from torch import nn

from threefold.comm.compression import DenseHook, DGCHook, OneBitAdamHook, PowerSGDHook
from threefold.parallel.comm_hook import make_comm_hook
from threefold.comm.compression.onebit import OneBitAllReduce, compress, decompress, pack_signs, unpack_signs
from threefold.comm.compression.powersgd import _Layout
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.parallel.buckets import GradientBuckets


def test_sign_packing_round_trip_and_best_scale():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    scales, signs = compress(x)
    assert torch.allclose(scales, x.abs().mean(1, keepdim=True))  # one scale per row by default
    approx = decompress(scales, signs)
    for s in (0.9, 1.1):  # mean |x| minimises ||x - s sign(x)||
        assert (x - approx).norm() < (x - decompress(scales * s, signs)).norm()
    assert OneBitAllReduce(1001, 4).chunk == 256  # blocks of whole sign bytes covering the tensor
    assert OneBitAllReduce(5000, 4).chunk == 1280 and OneBitAllReduce(5000, 4).groups == 5
    scales, signs = compress(x, group=16)
    assert scales.shape == (3, 4) and torch.allclose(decompress(scales, signs).abs(), scales.repeat_interleave(16, 1))


def test_dgc_warm_up_schedule():
    hook = DGCHook(sparsity=0.999, warmup_steps=4)
    densities = [hook.density(s) for s in range(6)]
    assert densities[0] == pytest.approx(0.25)
    assert densities[4] == densities[5] == pytest.approx(0.001)
    assert all(a > b for a, b in zip(densities[:4], densities[1:5]))
    assert [hook.selected(100_000, s) for s in (0, 4)] == [25_000, 100]
    assert hook.selected(10, 9) == 1  # at least one entry
    assert DGCHook(sparsity=0.5, warmup_steps=4).density(0) == 0.5  # nothing to warm up from


def test_powersgd_compresses_only_matrices_that_shrink():
    params = [nn.Parameter(torch.zeros(s)) for s in [(64, 32), (32,), (4, 4), (16, 8, 2)]]
    buckets = GradientBuckets(params, 1 << 30, launch=lambda b: None)
    layout = _Layout(buckets.buckets[0], rank=4)
    assert sorted((m.rows, m.cols) for m in layout.matrices) == [(16, 16), (64, 32)]
    assert layout.p_numel == 4 * (64 + 16) and layout.q_numel == 4 * (32 + 16)
    assert layout.dense_numel == 32 + 16


def test_one_process_and_plain_methods_pick_the_dense_hook():
    for method in ("none", "fp16", "bf16", "dgc", "onebit", "powersgd"):
        cfg = load_config(None, [f"compress.method={method}", "compress.warmup_steps=2"])
        hook = make_comm_hook(cfg.compress, cfg.train.grad_clip, cfg.train.seed, dp=1)
        assert isinstance(hook, DenseHook) and hook.wire_dtype is None and not hook.hierarchical
    pick = {m: make_comm_hook(load_config(None, [f"compress.method={m}", "compress.warmup_steps=2"]).compress, 0.0, 0, dp=4)
            for m in ("fp16", "bf16", "dgc", "onebit", "powersgd")}
    assert pick["fp16"].wire_dtype == torch.float16 and pick["bf16"].wire_dtype == torch.bfloat16
    assert isinstance(pick["dgc"], DGCHook) and isinstance(pick["powersgd"], PowerSGDHook)
    assert isinstance(pick["onebit"], OneBitAdamHook)


def test_optimizer_for_keeps_adamw_unless_one_bit_adam():
    p = nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([p])

    for hook in (DenseHook(), DGCHook(), PowerSGDHook()):
        assert hook.optimizer_for(adamw, None, "dp") is adamw
    adapted = OneBitAdamHook(warmup_steps=2).optimizer_for(adamw, None, "dp")
    assert type(adapted).__name__ == "OneBitAdam" and adapted.param_groups[0]["params"] == [p]


@pytest.mark.parametrize("overrides, key, words", [
    (["compress.method=dgc", "parallel.zero=3"], "compress.method", "ZeRO-3"),
    (["compress.method=powersgd", "parallel.zero=1"], "compress.method", "ZeRO-1"),
    (["compress.method=dgc", "parallel.zero=2"], "compress.method", "ZeRO-2"),
    (["compress.method=onebit", "compress.warmup_steps=5", "parallel.zero=2", "compress.onebit_adam=false"],
     "compress.method", "ZeRO-2"),
    (["compress.method=onebit", "compress.warmup_steps=0"], "compress.warmup_steps", "warm-up"),
    (["compress.method=dgc", "compress.hierarchical=true"], "compress.hierarchical", "all-gather"),
    (["compress.hierarchical=true", "parallel.zero=1"], "compress.hierarchical", "ZeRO reduce-scatters"),
    (["compress.dgc_sparsity=1.0"], "compress.dgc_sparsity", "[0, 1)"),
    (["compress.powersgd_rank=0"], "compress.powersgd_rank", "at least 1"),
])
def test_incompatible_combinations_are_clear_errors(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides).validate(4)
    assert str(err.value).startswith(key) and words in str(err.value)


def test_onebit_works_as_typed_with_an_automatic_warm_up():
    assert load_config(None, ["compress.method=onebit", "train.steps=50"]).validate(4).compress.warmup_steps == 10
    assert load_config(None, ["compress.method=onebit", "compress.warmup_steps=3"]).validate(4).compress.warmup_steps == 3
    assert load_config(None, ["compress.method=powersgd"]).validate(4).compress.warmup_steps == 0


def test_compatible_combinations_validate():
    for overrides in (["compress.method=fp16", "parallel.zero=3"], ["compress.method=bf16", "parallel.zero=1"],
                      ["compress.method=dgc"], ["compress.method=onebit", "compress.onebit_adam=false"],
                      ["compress.method=powersgd", "compress.hierarchical=true"]):
        load_config(None, overrides).validate(4)
