"""FP8 linears (parallel/fp8.py): the quantised matmul against a hand-written reference, the auto rule,
which linears convert, and fp8 training on one process (close to bf16, resuming bitwise)."""

import contextlib
import io

import pytest
import torch

from tests.helpers import make_config, rel_err
from threefold.checkpoint.format import step_dir_name
from threefold.parallel.fp8 import Fp8Kernel, Fp8Recipe, convert_linears
from threefold.planner.compute import fp8_gains
from threefold.planner.hardware import PRESETS, fp8_gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantise(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(values rounded to `dtype` after scaling, the scale): scale = max(dtype) / amax over `dim`."""
    t = t.float()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float()
    return q, scale


def reference_linear(x, w, recipe: str):
    """Quantise x and W, multiply in fp32, dequantise: the forward of an fp8 linear by hand."""
    rowwise = recipe == "rowwise"
    xq, sx = quantise(x, E4M3, -1 if rowwise else None, rowwise)
    wq, sw = quantise(w.t(), E4M3, 0 if rowwise else None, rowwise)  # W^T [K, N], per column over K
    return (xq @ wq) / (sx * sw)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_equals_quantise_matmul_dequantise(recipe):
    torch.manual_seed(0)
    x, w = torch.randn(40, 64) * 3, torch.randn(48, 64) * 0.05
    kernel = Fp8Kernel(Fp8Recipe.named(recipe), emulate=True)
    y = kernel(x, w, None)
    ref = reference_linear(x, w, recipe)
    assert rel_err(y, ref) <= 1e-6
    # within the rounding bound of e4m3 (3 mantissa bits: relative 2^-4 per operand, before saturation)
    exact = x @ w.t()
    bound = (2 * 2.0**-4 + 2.0**-8) * (x.abs() @ w.abs().t())
    assert ((y - exact).abs() <= bound + 1e-6).all()
    assert rel_err(y, exact) > 1e-4  # it really quantised


def test_backward_quantises_the_output_gradient_to_e5m2():
    torch.manual_seed(1)
    x = torch.randn(24, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(24, 16)
    Fp8Kernel(Fp8Recipe.named("tensorwise"), emulate=True)(x, w, None).backward(g)
    gq, sg = quantise(g, E5M2, None, False)
    wq, sw = quantise(w.detach().t(), E4M3, None, False)
    xq, sx = quantise(x.detach(), E4M3, None, False)
    assert rel_err(x.grad, (gq @ wq.t()) / (sg * sw)) <= 1e-6
    assert rel_err(w.grad, ((gq.t() @ xq) / (sg * sx))) <= 1e-6


def test_auto_rule_keeps_small_shapes_and_converts_large_ones():
    h200 = PRESETS["h200-141gb"]
    assert fp8_gpu("NVIDIA H200") == h200 and fp8_gpu("NVIDIA A100-SXM4-80GB") is None
    assert not fp8_gains(256, 32, 128, h200)  # a tiny model's linear: the casts cost more than they save
    assert not fp8_gains(2048, 768, 768, h200, "rowwise")
    assert fp8_gains(8192, 4096, 4096, h200) and fp8_gains(16384, 8192, 28672, h200, "rowwise")
    assert not fp8_gains(16384, 8192, 8192, PRESETS["a100-80gb"])  # no fp8 tensor cores


def _tiny(overrides):
    from threefold.models.registry import model_spec

    cfg = make_config(["model.preset=small", *overrides], "unused")
    model = model_spec(cfg.model, 0).build()
    return cfg, model


def test_which_linears_convert():
    from threefold.parallel.fp8 import Fp8Linear

    cfg, model = _tiny(["precision.compute=fp8"])
    report = convert_linears(model, cfg.precision, None, torch.device("cpu"), 256, cfg.model.layers, gains=None)
    assert report.converted == [] and len(report.kept) == 4 * 6  # auto on a CPU: none, and the line says why
    assert "0 of 24 block linears" in report.line() and "no fp8 tensor cores" in report.line()
    cfg, model = _tiny(["precision.compute=fp8", "precision.fp8_linears=all"])
    report = convert_linears(model, cfg.precision, None, torch.device("cpu"), 256, cfg.model.layers)
    assert len(report.converted) == 2 * 6 and all(n.startswith(("blocks.1.", "blocks.2.")) for n in report.converted)
    assert isinstance(model.blocks[1].attn.q, Fp8Linear) and type(model.blocks[0].attn.q) is torch.nn.Linear
    assert type(model.head) is torch.nn.Linear
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.1.attn.q.weight" in names  # parameter names (and so checkpoints) unchanged


def test_lora_adapters_stay_in_bf16_and_their_base_converts_in_place():
    """A base linear with LoRA-style adapters (children lora_A / lora_B, a forward hook adding B(A(x)), as
    parallel/lora.py builds them): the base converts where it is, its adapters and hook kept; the adapters'
    own linears never convert, and the line counts them apart from the block linears."""
    from torch import nn

    from threefold.parallel.fp8 import Fp8Linear

    cfg, model = _tiny(["precision.compute=fp8", "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"])
    q = model.blocks[1].attn.q
    torch.manual_seed(3)
    q.lora_A, q.lora_B = nn.Linear(q.in_features, 2, bias=False), nn.Linear(2, q.out_features, bias=False)
    q.register_forward_hook(lambda module, args, out: out + module.lora_B(module.lora_A(args[0])))
    report = convert_linears(model, cfg.precision, None, torch.device("cpu"), 256, cfg.model.layers)
    assert report.adapters == ["blocks.1.attn.q.lora_A", "blocks.1.attn.q.lora_B"]
    assert len(report.converted) == 4 * 6 and not any("lora" in n for n in report.converted)
    assert report.line().endswith("24 of 24 block linears compute in fp8; 2 LoRA adapter linears stay in bf16")
    assert model.blocks[1].attn.q is q and type(q) is Fp8Linear  # in place: its children and hook stay
    assert type(q.lora_A) is nn.Linear and type(q.lora_B) is nn.Linear
    x = torch.randn(2, 5, q.in_features)
    with torch.no_grad():
        want = reference_linear(x.reshape(-1, q.in_features), q.weight, "tensorwise").reshape(2, 5, -1) \
            + q.bias + (x @ q.lora_A.weight.t()) @ q.lora_B.weight.t()
        assert rel_err(q(x), want) <= 1e-6


FP8 = ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16", "train.lr=3e-3", "data.source=stdlib",
       "train.eps=1e-6"]
ALL = ["precision.compute=fp8", "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]


def _train(overrides, out):
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, str(out)))
        records = trainer.run()
    params = {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}
    return [r["loss"] for r in records], params, err.getvalue()


def test_fp8_trains_close_to_bf16_and_resumes_bitwise(tmp_path):
    bf16, _, _ = _train(FP8 + ["train.steps=6", "precision.compute=bf16"], tmp_path / "bf16")
    fp8, params, err = _train(FP8 + ALL + ["train.steps=6", "checkpoint.save_every=3"], tmp_path / "fp8")
    assert "12 of 12 block linears compute in fp8" in err
    assert fp8 != bf16 and max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 1e-2
    ckpt = tmp_path / "fp8" / "checkpoints" / step_dir_name(3)
    again, resumed, _ = _train(FP8 + ALL + ["train.steps=6", f"checkpoint.resume={ckpt}"], tmp_path / "again")
    assert again == fp8[3:]
    assert all(torch.equal(resumed[n], p) for n, p in params.items())


def test_plan_precision_fp8_says_which_linears_gain(capsys):
    import json

    from threefold.cli import main

    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "h200-141gb", "--precision", "fp8",
                 "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["fp8"]["gaining"] == ["qkv", "attn_out", "mlp_up", "mlp_down"]
    assert all(v["speedup"] > 1 for v in fp8["fp8"]["linears"].values())
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "h200-141gb", "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert "fp8" not in bf16 and fp8["candidates"][0]["tokens_per_s"] > bf16["candidates"][0]["tokens_per_s"]
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--gpu", "a100-80gb", "--precision", "fp8"]) == 0
    assert "0 of 4 block linears gain on a100-80gb" in capsys.readouterr().out


def test_fp8_is_refused_for_a_module_without_blocks():
    from threefold.errors import ConfigError

    with pytest.raises(ConfigError, match="precision.compute"):
        make_config(["model.preset=py:mypkg.models:build", "precision.compute=fp8"], "unused").validate(1)
