"""A block's memory-bound work between its GEMMs, by the software's kernels (planner/compute.py
`elementwise_bytes_per_token`, `Workload.elementwise`).

"torchtitan-eager" is torchtitan's Llama block as its benchmarks ran it without torch.compile (torchtitan
torchtitan/models/llama/model.py and models/norms.py, 2024): an RMSNorm module that casts to fp32, squares, takes the
mean, scales by the reciprocal root and casts back before the weight; rotary positions applied to q and k as complex
fp32 numbers; k and v heads repeated to the query heads by an expand and a copy; SiLU of w1's output times w3's. The
block below is written here from that description (its GEMMs and the attention kernel are priced elsewhere and left
out), run forward and backward on the CPU under a TorchDispatchMode, and every aten operation priced at the bytes its
GPU kernel moves over HBM: its tensor inputs read once (a broadcast input by its stored bytes) and its outputs
written once; views move nothing. The planner's closed form must give the same bytes per token."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from threefold.config import load_config
from threefold.planner.compute import block_forward_seconds, elementwise_bytes_per_token
from threefold.planner.hardware import PRESETS
from threefold.planner.search import evaluate
from threefold.planner.workload import Strategy, Workload

GEMMS = {"mm", "addmm", "bmm", "t", "linear", "matmul"}
VIEWS = {"alias", "detach", "slice", "view", "unsqueeze", "squeeze", "expand", "transpose", "select", "_unsafe_view",
         "as_strided", "reshape", "lift_fresh", "view_as_complex", "view_as_real", "permute", "_reshape_alias",
         "empty_like", "empty", "empty_strided", "flatten"}


class Traffic(TorchDispatchMode):
    """HBM bytes of the non-GEMM operations on tensors of at least `big` elements (per-row statistics, norm weights
    and the rotary table are smaller and left out)."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.bytes, self.off = big, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if self.off or name in GEMMS | VIEWS:
            return out

        def big(tree):
            return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.big]
        read = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in big((args, kwargs)))
        self.bytes += read + sum(t.numel() * t.element_size() for t in big(out))
        return out


MODE: Traffic | None = None


class _Attention(torch.autograd.Function):
    """The fused attention kernel's place: output and input gradients in the (batch, sequence, heads, head size)
    layout flash attention writes them in, moving nothing that is counted here."""

    @staticmethod
    def forward(ctx, q, k, v):
        MODE.off = True
        out = torch.empty_like(q.transpose(1, 2)).transpose(1, 2).copy_(q)
        MODE.off = False
        return out

    @staticmethod
    def backward(ctx, grad):
        MODE.off = True
        b, h, s, d = grad.shape
        grads = tuple(torch.empty(b, s, h, d, dtype=grad.dtype).transpose(1, 2).copy_(grad) for _ in range(3))
        MODE.off = False
        return grads


def _rms_norm(x, weight, eps=1e-5):
    up = x.float()
    return (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _rotary(x, table):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table).flatten(3).type_as(x)


def _repeat(x, times):
    b, s, heads, d = x.shape
    return x if times == 1 else x.unsqueeze(3).expand(b, s, heads, times, d).reshape(b, s, heads * times, d)


def _block(x, p, heads, kv_heads, table):
    b, s, h = x.shape
    d = h // heads
    n = _rms_norm(x, p["norm1"])
    q, k, v = (F.linear(n, p[w]).view(b, s, -1, d) for w in ("wq", "wk", "wv"))
    q, k = _rotary(q, table), _rotary(k, table)
    k, v = _repeat(k, heads // kv_heads), _repeat(v, heads // kv_heads)
    out = _Attention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    x = x + F.linear(out.transpose(1, 2).contiguous().view(b, s, -1), p["wo"])
    n = _rms_norm(x, p["norm2"])
    return x + F.linear(F.silu(F.linear(n, p["w1"])) * F.linear(n, p["w3"]), p["w2"])


def counted_bytes_per_token(h, heads, kv_heads, f, b=2, s=64):
    """(forward, backward) bytes per token of the eager block, counted."""
    global MODE
    d, gen = h // heads, torch.Generator().manual_seed(0)

    def param(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
    p = dict(norm1=param(h), norm2=param(h), wq=param(heads * d, h), wk=param(kv_heads * d, h),
             wv=param(kv_heads * d, h), wo=param(h, heads * d), w1=param(f, h), w3=param(f, h), w2=param(h, f))
    angles = torch.outer(torch.arange(s).float(), torch.rand(d // 2, generator=gen))
    table = torch.polar(torch.ones_like(angles), angles).view(1, s, 1, d // 2)
    x = param(b, s, h)
    MODE = Traffic(b * s * 24)
    with MODE:
        y = _block(x, p, heads, kv_heads, table)
        forward = MODE.bytes
        seed = torch.ones_like(y)
        MODE.bytes = 0
        y.backward(seed)
    return forward / (b * s), MODE.bytes / (b * s)


@pytest.mark.parametrize("h,heads,kv_heads,f", [(256, 4, 2, 512), (512, 8, 2, 768), (256, 4, 4, 512),
                                                 (256, 4, 1, 512)])
def test_torchtitans_eager_block_moves_what_its_kernels_move(h, heads, kv_heads, f):
    """Grouped (a copy of the repeated heads), plain (nothing repeated) and single-kv-head attention (the repeat
    is a view; its gradient is still summed)."""
    base = load_config(None, ["model.preset=llama-7b"]).model
    m = replace(base, hidden=h, heads=heads, kv_heads=kv_heads, ffn_hidden=f)
    counted = counted_bytes_per_token(h, heads, kv_heads, f)
    model = elementwise_bytes_per_token(m, 1, False, "torchtitan-eager")
    assert model[0] == pytest.approx(counted[0], rel=1e-3) and model[1] == pytest.approx(counted[1], rel=1e-3), \
        (model, counted)


def test_fused_kernels_are_charged_as_before():
    """One read and one write per element and operation, the backward twice the forward (the charge of every row
    before the software's kernels were told apart): Llama 3.1 8B per token, bf16, one rank."""
    m = load_config(None, ["model.preset=llama-7b"]).model
    h, f, q, kv = m.hidden, m.ffn_hidden, m.attn_width, m.kv_heads * m.head_dim
    forward = 2 * (10 * h + 3 * f + 2 * (q + kv))
    assert elementwise_bytes_per_token(m, 1, False) == (forward, 2 * forward)
    sharded = elementwise_bytes_per_token(m, 4, True)[0]
    assert sharded == pytest.approx(forward / 4)


def test_torchtitans_eager_8b_block_is_slower_than_fused_kernels():
    """Llama 3.1 8B, two 8,192-token sequences on an H100: the eager passes move 3.3x the fused bytes per token
    (forward and backward), and the block is charged for them; a Workload names its kind from the choices."""
    m = load_config(None, ["model.preset=llama-7b"]).model
    m = replace(m, vocab=128256, kv_heads=8, ffn_hidden=14336, max_seq=8192)
    eager, fused = (sum(elementwise_bytes_per_token(m, 1, False, k)) for k in ("torchtitan-eager", "fused"))
    assert 3.2 < eager / fused < 3.4
    gpu = PRESETS["h100-80gb"]
    slow, fast = (block_forward_seconds(m, 2, 8192, 1, False, "flash", gpu, "bf16", 1, k)[0]
                  for k in ("torchtitan-eager", "fused"))
    assert slow - fast == pytest.approx(2 * 8192 * (eager - fused) / 3 / gpu.hbm_bytes_per_s / gpu.compute_efficiency)
    steps = [evaluate(Workload(m, 16, 8192, elementwise=k), Strategy(dp=8, zero=3, remat="selective"), gpu).time
             for k in ("torchtitan-eager", "fused")]
    assert steps[0].total_s > 1.1 * steps[1].total_s
    with pytest.raises(ValueError, match="Workload.elementwise: unknown 'compiled'"):
        Workload(m, 16, 8192, elementwise="compiled")
