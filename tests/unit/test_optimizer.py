"""The fp32-master optimizer with momentum SGD: pieces equal whole tensors, states round-trip, DGC's momentum."""

from dataclasses import replace

import pytest
import torch

from tests.helpers import flat_pieces

from threefold.comm.compression import DenseHook, DGCHook
from threefold.config import TrainConfig
from threefold.parallel import ParallelModel
from threefold.parallel.data import DataParallelReducer
from threefold.parallel.master import ShardedOptimizer

SGD = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-2)


def _steps(opt: ShardedOptimizer, grad: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        grad.copy_(g)
        opt.prepare_grads(1.0)
        opt.step()


@pytest.mark.parametrize("offload, nesterov", [(False, False), (True, False), (False, True)])
def test_pieces_update_exactly_like_whole_sgd(offload, nesterov):
    cfg = replace(SGD, nesterov=nesterov)
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    mine = ref.detach().clone()
    grad = torch.zeros_like(mine)
    whole = torch.optim.SGD([ref], lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, weight_decay=cfg.weight_decay,
                            foreach=False)
    opt = ShardedOptimizer(flat_pieces(mine, grad, [7, 19]), cfg, offload=offload)
    # the momentum buffers exist before the first step: counted and checkpointable from step 0
    assert sum(t.numel() for t in opt.state_tensors()) == 30 * (2 if offload else 1)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(4)]
    for g in grads:
        ref.grad = g.clone()
        whole.step()
    _steps(opt, grad, grads)
    assert torch.equal(mine, ref.detach())
    assert opt.step_count() == 4
    names = [place.name for place, _ in opt.named_state()]
    assert names.count("optimizer.momentum_buffer.w") == 3 and not any("exp_avg" in n for n in names)
    assert torch.equal(torch.cat([t for p, t in opt.named_state() if "momentum" in p.name]),
                       whole.state[ref]["momentum_buffer"].view(-1))


def test_momentum_buffers_round_trip_like_a_checkpoint():
    """Save = read named_state; load = fill the same names in place, then after_load (checkpoint/state.py)."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=gen) for _ in range(5)]
    init = torch.randn(4, 3, generator=gen)

    def fresh():
        param, grad = init.clone(), torch.zeros(4, 3)
        return param, grad, ShardedOptimizer(flat_pieces(param, grad, []), SGD)

    param_a, grad_a, a = fresh()
    _steps(a, grad_a, grads[:3])
    saved = {place.name: t.clone() for place, t in a.named_state()}
    assert set(saved) == {"optimizer.momentum_buffer.w"} and saved["optimizer.momentum_buffer.w"].abs().sum() > 0
    _steps(a, grad_a, grads[3:])

    param_b, grad_b, b = fresh()
    _steps(b, grad_b, grads[:3])  # the parameters of `a` at step 3; then the momentum is lost ...
    for _, t in b.named_state():
        t.zero_()
    for place, t in b.named_state():  # ... and loaded back
        t.copy_(saved[place.name])
    b.after_load(3, masters_loaded=False)
    assert b.step_count() == 3
    _steps(b, grad_b, grads[3:])
    assert torch.equal(param_b, param_a)
    # without the momentum the continued run differs: the round trip is what makes it equal
    param_c, grad_c, c = fresh()
    _steps(c, grad_c, grads[:3])
    for _, t in c.named_state():
        t.zero_()
    _steps(c, grad_c, grads[3:])
    assert not torch.equal(param_c, param_a)


def test_adamw_step_count_survives_after_load():
    param, grad = torch.zeros(5), torch.zeros(5)
    opt = ShardedOptimizer(flat_pieces(param, grad, [2]), TrainConfig(lr=1e-2))
    assert {p.name for p, _ in opt.named_state()} == {"optimizer.exp_avg.w", "optimizer.exp_avg_sq.w"}
    opt.after_load(7, masters_loaded=False)
    assert opt.step_count() == 7 and all(int(s["step"]) == 7 for s in opt.state.values())


@pytest.mark.parametrize("hook, momentum", [(DenseHook(), 0.9), (DGCHook(momentum_correction=True), 0.0),
                                            (DGCHook(momentum_correction=False), 0.9)])
def test_dgc_momentum_correction_takes_the_optimizer_momentum(hook, momentum):
    param = torch.nn.Parameter(torch.zeros(3, 2))

    class Sync:  # the data-parallel reducer's view of its hook, without the buckets
        applies_momentum = DataParallelReducer.applies_momentum
        optimizer_for = DataParallelReducer.optimizer_for

    sync = Sync()
    sync.hook, sync.comm, sync.axis = hook, None, "dp"
    parallel = ParallelModel(torch.nn.Linear(2, 3), sync, {}, flat_pieces(param.detach(), torch.zeros(3, 2), []))
    opt = parallel.make_optimizer(replace(SGD, nesterov=True))
    assert opt.inner.defaults["momentum"] == momentum and opt.inner.defaults["nesterov"] == bool(momentum)
    assert len(opt.named_state()) == (1 if momentum else 0)
    adamw = parallel.make_optimizer(TrainConfig())
    assert isinstance(adamw.inner, torch.optim.AdamW)
