"""MXFP8 linears (parallel/mxfp8.py): the three matmuls against a hand-written OCP MX quantisation, which
linears convert, the one-line refusals, and a short run on one process."""

import pytest
import torch

from tests.helpers import make_config, rel_err
from threefold.config import load_config
from threefold.config.checks import validate
from threefold.errors import ConfigError
from threefold.parallel.fp8 import convert_linears
from threefold.config.installed import mx_support
from threefold.parallel.mxfp8 import MxKernel

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn


def mx_quantise(t: torch.Tensor) -> torch.Tensor:
    """`t` (R x C) as MXFP8 values, written from the OCP MX 1.0 spec: each 1x32 block of a row shares one
    power-of-two scale X (an e8m0 exponent) and its elements are X times e4m3 values. X is the smallest
    power of two with amax / X <= 448 (the rule NVIDIA's block-scaled GEMMs and torchao's MXFP8 training
    recipes use, so no element saturates; the spec's example rule, 2^(floor(log2 amax) - 8), may clamp
    the largest elements). Rows are zero-padded to whole blocks; a zero changes no amax."""
    t = t.float()
    pad = -t.shape[1] % 32
    t = torch.cat([t, t.new_zeros(t.shape[0], pad)], 1) if pad else t
    blocks = t.reshape(t.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mantissa x 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two is its own X
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))
    elements = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (elements * scale).reshape(t.shape)[:, : t.shape[1] - pad]


def test_the_three_matmuls_equal_the_hand_written_mx_reference():
    """Output, input gradient and weight gradient against quantise-by-hand then an fp32 matmul, each
    operand blocked along the GEMM's contracted dimension. Both sides multiply the same MX values (exact
    in fp32), so only the order of the fp32 sums differs: at most K x 2^-24 relative per sum (K <= 96 here,
    under 6e-6); the bound is 1e-5. Rows span 2^-12..2^12 in magnitude, so the 32-blocks get different
    scales, and M = 40 is no multiple of 32 (the weight gradient's blocks along M end in a partial one)."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 40, 64, 96
    x = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 12, (m, k // 32, 1), generator=gen)
                                                       .float()).repeat_interleave(32, 1).reshape(m, k))
    x.requires_grad_(True)
    w = (torch.randn(n, k, generator=gen) * 0.05).requires_grad_(True)
    g = torch.randn(m, n, generator=gen)
    y = MxKernel(emulate=True)(x, w, None)
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    want_y = mx_quantise(xd) @ mx_quantise(wd).t()  # blocks along K
    want_dx = mx_quantise(g) @ mx_quantise(wd.t()).t()  # dY blocks along N, W^T blocks along N
    want_dw = mx_quantise(g.t()) @ mx_quantise(xd.t()).t()  # dY^T and x^T blocks along M
    y = y.detach()
    errors = {"y": rel_err(y, want_y), "dx": rel_err(x.grad, want_dx), "dw": rel_err(w.grad, want_dw)}
    assert max(errors.values()) <= 1e-5, errors
    # it quantised: 3 mantissa bits leave each operand up to 2^-4 off
    assert rel_err(y, xd @ wd.t()) > 1e-3 and rel_err(w.grad, g.t() @ xd) > 1e-3


def _small(overrides):
    from threefold.models.registry import model_spec

    cfg = make_config(overrides, "unused")
    return cfg, model_spec(cfg.model, 0).build()


def test_same_linears_as_fp8_and_blocks_that_do_not_fit_stay_bf16():
    from threefold.parallel.fp8 import Fp8Linear

    cfg, model = _small(["model.preset=tiny-moe", "precision.compute=mxfp8", "precision.fp8_linears=all",
                         "precision.fp8_skip_first_last=false"])
    report = convert_linears(model, cfg.precision, None, torch.device("cpu"), 64, cfg.model.layers)
    assert isinstance(model.blocks[0].attn.q.kernel, MxKernel) and isinstance(model.blocks[0].attn.q, Fp8Linear)
    # k and v (2 heads of 8: N=16) and the experts (width 48) fit no whole block: kept in bf16, the line says why
    assert sorted(report.kept) == [f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.k", "attn.v", "mlp.experts")]
    assert report.converted == [f"blocks.{i}.attn.{m}" for i in (0, 1) for m in ("q", "o")]
    assert "mxfp8: 4 of 10" in report.line() and "N=48 not a multiple of the 32-element MX block" in report.line()
    assert model.head.__class__ is torch.nn.Linear and all(".router" not in n for n in report.converted)
    cfg, model = _small(["model.preset=small", "precision.compute=mxfp8"])  # auto on a CPU: none
    report = convert_linears(model, cfg.precision, None, torch.device("cpu"), 64, cfg.model.layers)
    assert report.converted == [] and "no mxfp8 tensor cores" in report.line()


def test_refused_in_one_line_without_torchao_mx(monkeypatch):
    assert mx_support() is None  # the pinned torchao 0.18.0 has it
    monkeypatch.setattr("threefold.config.installed.mx_support", lambda: "torchao 0.9.0 is installed")
    cfg = load_config(None, ["model.preset=tiny", "precision.compute=mxfp8"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    line = err.value.line()
    assert "\n" not in line and "precision.compute" in line and "torchao>=0.18" in line and "0.9.0" in line
    validate(load_config(None, ["model.preset=tiny", "precision.compute=fp8"]), 1)  # fp8 does not need it


@pytest.mark.parametrize("overrides,named", [(["model.preset=tiny"], "model.hidden (attention width)=32"),
                                             (["model.preset=tiny-llama", "model.hidden=64"], "model.ffn_hidden=96")])
def test_tp_that_splits_a_block_is_refused_naming_the_dimension(overrides, named):
    with pytest.raises(ConfigError, match="parallel.tp") as err:
        validate(load_config(None, [*overrides, "precision.compute=mxfp8", "parallel.tp=2"]), 2)
    assert named in str(err.value) and "leaves" in str(err.value)
    validate(load_config(None, ["model.preset=tiny", "model.hidden=64", "precision.compute=mxfp8",
                                "parallel.tp=2"]), 2)


def test_trains_close_to_bf16_on_one_process(tmp_path):
    from threefold.train.trainer import Trainer

    base = ["model.preset=tiny", "train.steps=4", "train.global_batch=4", "train.seq_len=16", "train.lr=3e-3",
            "data.source=stdlib"]
    losses = {}
    for compute in ("bf16", "mxfp8"):
        extra = ["precision.fp8_linears=all", "precision.fp8_skip_first_last=false"] if compute == "mxfp8" else []
        trainer = Trainer(make_config([*base, f"precision.compute={compute}", *extra], str(tmp_path / compute)))
        losses[compute] = [r["loss"] for r in trainer.run()]
    assert losses["mxfp8"] != losses["bf16"]
    assert max(abs(a - b) / b for a, b in zip(losses["mxfp8"], losses["bf16"])) < 2e-2, losses
