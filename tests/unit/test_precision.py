"""Mixed precision pieces that need no process group: loss scaler, casting, the fp32-master AdamW."""

import pytest
import torch

from tests.helpers import flat_pieces

from threefold.config import PrecisionConfig, TrainConfig
from threefold.parallel.master import ShardedOptimizer
from threefold.parallel.precision import DynamicLossScaler, apply_precision, resolve_reduce_dtype


def test_loss_scaler_grows_backs_off_and_round_trips():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, growth_factor=2.0, backoff_factor=0.25, min_scale=1.0)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 8.0
    s.update(found_inf=False)
    assert s.scale == 16.0 and s.clean_steps == 0
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow also restarts the count of clean steps
    assert s.scale == 4.0 and s.clean_steps == 0 and s.skipped_steps == 1
    for _ in range(3):
        s.update(found_inf=True)
    assert s.scale == 1.0  # never below min_scale
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps, t.skipped_steps) == (s.scale, s.clean_steps, s.skipped_steps)


def test_apply_precision_casts_and_keeps_fp32_values():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mp = apply_precision(model, PrecisionConfig(compute="bf16"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(mp.fp32_init[n], before[n]) for n in before)
    assert mp.reduce_dtype == torch.float32 and mp.scaler is None and mp.loss_scale == 1.0
    assert apply_precision(torch.nn.Linear(2, 2), PrecisionConfig(compute="fp16")).scaler is not None
    assert apply_precision(torch.nn.Linear(2, 2), PrecisionConfig()).fp32_init == {}
    assert resolve_reduce_dtype(PrecisionConfig(compute="bf16", reduce_dtype="compute")) == torch.bfloat16


@pytest.mark.parametrize("offload", [False, True])
def test_pieces_update_exactly_like_whole_adamw(offload):
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    mine = ref.detach().clone()
    grad = torch.zeros_like(mine)
    whole = torch.optim.AdamW([ref], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.1,
                              foreach=False)
    opt = ShardedOptimizer(flat_pieces(mine, grad, [7, 19]), cfg, offload=offload)
    assert opt.aliased == [not offload] * 3
    for _ in range(3):
        g = torch.randn(6, 5, generator=gen)
        ref.grad = g.clone()
        grad.copy_(g)
        whole.step()
        opt.prepare_grads(1.0)
        opt.step()
    assert torch.equal(mine, ref.detach())
    assert opt.step_count() == 3
    named = dict((place.name, (place, t)) for place, t in opt.named_state()[:3])
    assert set(named) >= {"optimizer.exp_avg.w", "optimizer.exp_avg_sq.w"}
    assert sum(t.numel() for t in opt.state_tensors()) == 30 * (3 if offload else 2)


def test_unscaling_and_bf16_masters():
    cfg = TrainConfig(lr=1e-3, weight_decay=0.0)
    model = torch.zeros(8, dtype=torch.bfloat16)
    grad = torch.full((8,), 1024.0, dtype=torch.bfloat16)
    init = torch.full((8,), 1.0 + 2.0**-12)  # not representable in bf16
    opt = ShardedOptimizer(flat_pieces(model, grad, [4]), cfg, fp32_init={"w": init})
    assert torch.equal(opt.masters[0].data, init[:4]) and not any(opt.aliased)
    masters, _ = opt.prepare_grads(1.0 / 1024)
    assert all(torch.equal(m.grad, torch.ones(4)) for m in masters)  # unscaled, in fp32
    opt.step()
    assert torch.equal(model, (init - 1e-3).to(torch.bfloat16))  # Adam's first step moves by lr


def test_auto_precision_is_bf16_reduced_in_bf16_on_cuda_and_fp32_elsewhere():
    from threefold.parallel.precision import set_tf32

    auto = PrecisionConfig()
    assert (auto.compute, auto.reduce_dtype, auto.tf32) == ("auto", "auto", True)
    on_gpu, on_cpu = auto.for_device("cuda"), auto.for_device("cpu")
    assert (on_gpu.compute, on_gpu.reduce_dtype) == ("bf16", "compute")
    assert (on_cpu.compute, on_cpu.reduce_dtype) == ("fp32", "fp32")
    chosen = PrecisionConfig(compute="fp16", reduce_dtype="fp32")
    assert chosen.for_device("cuda") == chosen  # a choice is kept
    mp = apply_precision(torch.nn.Linear(2, 2), auto, "cuda")
    assert (mp.compute_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert resolve_reduce_dtype(PrecisionConfig(compute="bf16"), "cpu") == torch.float32
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        set_tf32(torch.device("cpu"), not before)
        assert torch.backends.cuda.matmul.allow_tf32 == before  # only a CUDA run changes it
        set_tf32(torch.device("cuda"), not before)
        assert torch.backends.cuda.matmul.allow_tf32 == (not before)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        torch.backends.cudnn.allow_tf32 = True
