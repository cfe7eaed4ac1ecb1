"""The planner's host floor: small models are bounded by operator dispatch, and the default batch
follows the model's size (planner/dispatch.py, planner/command.py)."""

import json
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from threefold.cli import main
from threefold.config import ModelConfig
from threefold.models.decoder import Block
from threefold.config.presets import PRESETS
from threefold.planner.command import default_batch_tokens
from threefold.planner.dispatch import PER_EXPERT_OPS, SPARSE_BLOCK_OPS, dense_block_ops
from threefold.planner.hardware import PRESETS as GPUS
from threefold.planner.search import evaluate
from threefold.planner.workload import Strategy, Workload


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _block_ops(cfg: ModelConfig, sparse: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    with torch.device("meta"):
        block = Block(cfg, sparse)
    block.to_empty(device="cpu")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 16, cfg.hidden, requires_grad=True)
    forward, backward = _Count(), _Count()
    with forward:
        y = block(x)
    with backward:
        y.sum().backward()
    return forward.ops, backward.ops


@pytest.mark.parametrize("variant", [{}, {"norm": "rmsnorm"}, {"position": "rope"}, {"mlp": "swiglu"},
                                     {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu", "kv_heads": 2}])
def test_dense_block_operator_counts_are_the_blocks(variant):
    cfg = replace(ModelConfig(**PRESETS["tiny"]), **variant)
    fwd, bwd = _block_ops(cfg, False)
    want = dense_block_ops(cfg)
    assert 0.7 * fwd <= want[0] <= 1.3 * fwd and 0.7 * bwd <= want[1] <= 1.3 * bwd, (fwd, bwd, want)


def test_sparse_block_operator_counts_are_the_blocks():
    cfg = ModelConfig(**PRESETS["tiny-moe"])
    for experts in (2, 8):
        fwd, bwd = _block_ops(replace(cfg, experts=experts), True)
        want = (SPARSE_BLOCK_OPS[0] + experts * PER_EXPERT_OPS[0], SPARSE_BLOCK_OPS[1] + experts * PER_EXPERT_OPS[1])
        assert 0.6 * fwd <= want[0] <= 1.4 * fwd and 0.6 * bwd <= want[1] <= 1.4 * bwd, (experts, fwd, bwd, want)


def test_a_tiny_model_is_bounded_by_dispatch_not_flops(capsys):
    """A 36k-parameter model on 8 H100 was predicted at 1.6e10 tokens/s: each micro-batch's forward
    and backward issue ~400 operators at 4 us, so a step of one sequence per GPU cannot beat ~1.5 ms."""
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert best["tokens_per_s"] < 1e6, best["tokens_per_s"]
    assert best["step_time_s"] > 1e-3


def test_the_floor_leaves_large_models_alone():
    m = ModelConfig(**PRESETS["llama-7b"])
    w, st = Workload(m, 512, 4096), Strategy(dp=8, zero=1, microbatches=64)
    gpu = GPUS["h100-80gb"]
    with_floor, without = evaluate(w, st, gpu).time.total_s, evaluate(w, st, replace(gpu, op_overhead_s=0.0)).time.total_s
    assert with_floor == pytest.approx(without, rel=1e-9)


def test_the_default_batch_follows_the_model_size(capsys):
    assert [default_batch_tokens(n) for n in (125e6, 1.3e9, 7e9, 70e9)] == [2**19, 2**20, 2**21, 2**22]
    assert default_batch_tokens(35_700) < 200
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "assumed global batch 2 x 64 = 128 tokens per step" in out, out  # kept: dp 2 tp 2 pp 2 splits it
    assert main(["plan", "--model", "gpt2-124m", "--gpus", "8", "--top", "1"]) == 0
    assert "assumed global batch 512 x 1024 = 524,288 tokens" in capsys.readouterr().out
