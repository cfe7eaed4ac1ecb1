"""The per-tensor work of a step done as multi-tensor operations, with the per-tensor math's bits:
the master gradients' fp32 copies and unscaling, the updated masters' copies into the model, the
gradient buckets' zeroing. (tests/distributed/test_step_ops.py counts a whole step's operations.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from threefold.config import TrainConfig
from threefold.parallel.buckets import GradientBuckets
from threefold.parallel.master import Piece, ShardedOptimizer
from threefold.sharding import Placement


class _Ops(TorchDispatchMode):
    """Every operation dispatched, views included (each is host work)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _params(n: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(n)
    return [torch.nn.Parameter(torch.randn(3 + i % 4, 5, generator=gen).to(dtype)) for i in range(n)]


@pytest.mark.parametrize("n", [3, 30])
def test_zeroing_the_buckets_is_one_operation_whatever_the_tensor_count(n):
    params = _params(n)
    buckets = GradientBuckets(params, 1 << 20, launch=lambda bucket: None)
    for p in params:
        p.grad.fill_(1.0)
    params[1].grad = None  # replaced (ZeRO-2 releases a bucket's gradients): pointed back at its view
    with _Ops() as counted:
        buckets.zero_grad()
    assert counted.ops == ["aten._foreach_zero_.default"], counted.ops
    for p in params:
        assert p.grad is not None and not p.grad.any()
        assert p.grad.untyped_storage().data_ptr() == buckets.bucket_of(p).buffer.untyped_storage().data_ptr()


def _pieces(params: list[torch.nn.Parameter]) -> list[Piece]:
    return [Piece(f"p{i}", Placement.whole(f"p{i}", p.shape), p.detach().view(-1), (lambda p=p: p.grad.view(-1)),
                  p.dim() >= 2) for i, p in enumerate(params)]


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, None), (torch.float16, 1024.0), (torch.float32, 512.0),
                                          (torch.float32, None)])
def test_master_gradients_and_model_copies_have_the_per_tensor_bits(dtype, scale):
    params = _params(7, dtype)
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 100).to(dtype)
    opt = ShardedOptimizer(_pieces(params), TrainConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1))
    inv = None if scale is None else 1.0 / torch.tensor(scale)
    # the old per-tensor math
    expected = []
    for p in params:
        g = p.grad.detach().view(-1).to("cpu", torch.float32, copy=True)
        expected.append(g.mul_(inv) if inv is not None else g)
    masters, _ = opt.prepare_grads(1.0 if inv is None else inv)
    for master, want in zip(masters, expected):
        assert master.grad.dtype == torch.float32 and torch.equal(master.grad, want)
    if dtype == torch.float32 and inv is None:  # the model's own gradients, no copy
        assert all(m.grad.data_ptr() == p.grad.data_ptr() for m, p in zip(masters, params))
    opt.step(torch.zeros(()))
    for master, p in zip(masters, params):
        assert torch.equal(p.detach().view(-1), master.detach().to(dtype)), "the model holds the master's rounding"
        assert master.grad is None
