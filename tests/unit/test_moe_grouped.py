"""The experts as one batched matmul (padded `torch.bmm`) or one grouped matmul (`torch._grouped_mm`, which
this CPU build also runs in fp32) against a plain per-expert loop written here: outputs and every gradient
within 1e-5; the op counts (3 matmuls per expert forward against 3 in all); the padding rule."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import rel_err
from threefold.config import load_config
from threefold.models.moe import Experts, _grouped_mm_runs, expert_kernel

COUNTS = [5, 0, 9, 7]  # an expert without rows included


def make_experts(mlp: str) -> Experts:
    cfg = load_config(None, ["model.preset=tiny-moe", f"model.mlp={mlp}"]).model
    experts = Experts(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return experts


def plain_loop(rows, counts, w_gate, w_up, w_down):
    """Expert by expert, row by row block: y = W_down act(x W_up^T [, x W_gate^T])."""
    outs, start = [], 0
    for j, n in enumerate(counts):
        x = rows[start: start + n]
        start += n
        up = x @ w_up[j].t()
        act = F.silu(x @ w_gate[j].t()) * up if w_gate is not None else F.gelu(up, approximate="tanh")
        outs.append(act @ w_down[j].t())
    return torch.cat(outs)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("kernel", ["padded", "grouped", "auto"])
def test_batched_experts_match_a_per_expert_loop(mlp, kernel):
    experts = make_experts(mlp)
    experts.kernel = kernel
    rows = torch.randn(sum(COUNTS), experts.w_up.shape[2], generator=torch.Generator().manual_seed(1),
                       requires_grad=True)
    names = [n for n, _ in experts.named_parameters()]
    plain = {n: p.detach().clone().requires_grad_() for n, p in experts.named_parameters()}
    y = experts(rows, COUNTS)
    ref_rows = rows.detach().clone().requires_grad_()
    ref = plain_loop(ref_rows, COUNTS, plain.get("w_gate"), plain["w_up"], plain["w_down"])
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (y * g).sum().backward()
    (ref * g).sum().backward()
    assert experts.last_kernel == ("padded" if kernel == "auto" else kernel)  # the CPU: no grouped in auto
    assert rel_err(y.detach(), ref.detach()) <= 1e-5
    assert rel_err(rows.grad, ref_rows.grad) <= 1e-5
    for n in names:
        assert rel_err(dict(experts.named_parameters())[n].grad, plain[n].grad) <= 1e-5, n
    assert experts.w_up.grad[1].abs().sum() == 0  # the expert without rows: a zero gradient, not none


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def matmuls(kernel: str) -> tuple[dict, dict]:
    experts = make_experts("swiglu")
    experts.kernel = kernel
    rows = torch.randn(sum(COUNTS), experts.w_up.shape[2], requires_grad=True)
    with OpCount() as fwd:
        y = experts(rows, COUNTS)
    with OpCount() as bwd:
        y.square().sum().backward()
    keep = ("mm", "bmm", "_grouped_mm", "matmul")
    return ({k: v for k, v in fwd.ops.items() if k in keep}, {k: v for k, v in bwd.ops.items() if k in keep})


def test_one_batched_matmul_per_weight_instead_of_one_per_expert():
    """Forward: the loop runs 3 matmuls per expert (gate, up, down: 12 for 4 experts), the padded and the
    grouped kernels 3 in all; backward: 2 per matmul (input and weight gradients) - 24 against 6."""
    e = len(COUNTS)
    loop_f, loop_b = matmuls("loop")
    assert loop_f == {"mm": 3 * e} and sum(loop_b.values()) == 2 * 3 * e
    bmm_f, bmm_b = matmuls("padded")
    assert bmm_f == {"bmm": 3} and bmm_b == {"bmm": 6}
    grouped_f, grouped_b = matmuls("grouped")
    assert grouped_f == {"_grouped_mm": 3} and sum(grouped_b.values()) == 6


def test_padding_rule_and_capability_test():
    """Padded when max count x experts <= 2 x rows (here 9 x 4 = 36 <= 42), the loop when one expert takes
    most rows (40 x 4 = 160 > 2 x 43); the grouped kernel never assumed: the capability test runs it, and
    on the CPU it is not asked for."""
    rows = torch.zeros(sum(COUNTS), 32)
    assert expert_kernel(rows, COUNTS, 32, 48) == "padded"
    skewed = [40, 1, 1, 1]
    assert expert_kernel(torch.zeros(43, 32), skewed, 32, 48) == "loop"
    assert not _grouped_mm_runs(torch.device("cpu"), torch.float32)
