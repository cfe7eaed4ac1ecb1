"""MXFP8 training of the blocks' linears (`precision.compute=mxfp8`, docs/fp8.md).

MXFP8 is the OCP Microscaling format with float8 e4m3 elements: every run of 32 consecutive values
along a GEMM's contracted dimension (a 1x32 block) shares one power-of-two scale, stored as an e8m0
exponent. Each of a linear's three matmuls casts both operands so, blocks along its own contracted
dimension (torchao's `mx_mm` layouts):

    output       x[M,K]  (blocks along K) @ W^T[K,N] (blocks along K)
    grad input   dY[M,N] (blocks along N) @ W[N,K]   (blocks along N)
    grad weight  dY^T[N,M] (blocks along M) @ x[M,K] (blocks along M)

The cast and the matmul are torchao's (`torchao.prototype.mx_formats`: `MXTensor.to_mx`, whose
`torch.mm` is the block-scaled `torch._scaled_mm` on Blackwell tensor cores and, with
`KernelPreference.EMULATED`, a matmul of the dequantised operands on every other device), with
the scale rule of torchao's MXFP8 training recipes (`ScaleCalculationMode.RCEIL`: the smallest power
of two >= amax / 448, so no element saturates). threefold writes the autograd function around them
(`MxMatmul`) for what `mx_mm` lacks: the sequence-parallel shard saved instead of the whole input,
and the weight gradient over any number of rows (M zero-padded to the block, which leaves every
block's amax and the product unchanged).

A block never spans two ranks when every dimension tensor parallelism splits is a multiple of 32 on
each rank: then tp=2 quantises exactly as one process does, with no reduction of any amax (unlike
tensorwise fp8), and a layout that cannot give that is refused (config/installed.py `mxfp8_refusal`, `misfit`).
"""

from __future__ import annotations

import torch

from ..config.installed import BLOCK, quiet_torchao, torchao_mx


def hardware_mx(device: torch.device) -> bool:
    """True where `torch._scaled_mm` takes MX block scales on tensor cores (CUDA compute capability 10.0 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def misfit(k: int, n: int) -> str | None:
    """Why a GEMM with contracted width K and output width N cannot be cast in whole blocks, or None."""
    bad = [f"{name}={v}" for name, v in (("K", k), ("N", n)) if v % BLOCK]
    return f"{' and '.join(bad)} not a multiple of the {BLOCK}-element MX block" if bad else None


class MxKernel:
    """The MXFP8 matmul of one linear (an `Fp8Kernel`'s interface, parallel/tensor.py `LinearKernel`)."""

    takes_cast_weights = False  # ZeRO-3's fp8 gather sends tensorwise weights only

    def __init__(self, emulate: bool):
        self._mx, pref, mode = torchao_mx()
        self.emulate = emulate
        self.preference = pref.EMULATED if emulate else pref.AUTO
        self.mode = mode.RCEIL

    def cast(self, t: torch.Tensor):
        """`t` (2-D) as an MXTensor, one e8m0 scale per 32 consecutive elements of each row."""
        return self._mx.to_mx(t.contiguous(), torch.float8_e4m3fn, BLOCK, self.mode, self.preference)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 shard: tuple[torch.Tensor, object] | None = None) -> torch.Tensor:
        """y = x W^T + b with MXFP8 GEMMs; `shard` as `Fp8Kernel` takes it (sequence parallelism)."""
        y = MxMatmul.apply(x, weight, self, shard)
        return y if bias is None else y + bias.to(y.dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` (M x F) with zero rows up to a multiple of the block: a zero adds nothing to a block's amax or a sum."""
    extra = -t.shape[0] % BLOCK
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


def save_matmul_operands(ctx, x: torch.Tensor, weight: torch.Tensor, kernel, shard, y: torch.Tensor) -> torch.Tensor:
    """Save what a low-precision linear's backward reads (this file's and fp8.py's): the weight and the
    input - or, under sequence parallelism, the input's shard (`shard`: (shard, its regather), all-gathered
    again under the input-gradient matmul) - with the kernel and the input's shape; returns the forward's
    product `y` (rows x out) in the input's leading shape."""
    if shard is not None:
        regather = shard[1]
        regather.uses += regather.open
        ctx.save_for_backward(shard[0], weight)
    else:
        ctx.save_for_backward(x, weight)
    ctx.kernel, ctx.regather, ctx.x_shape = kernel, None if shard is None else shard[1], x.shape
    return y.reshape(*x.shape[:-1], y.shape[-1])


def saved_matmul_operands(ctx) -> tuple:
    """`save_matmul_operands`' input (or shard), weight and kernel, back in the backward; a shard's
    all-gather is started here, to run under the input-gradient matmul."""
    saved, weight = ctx.saved_tensors
    if ctx.regather is not None:
        ctx.regather.start(saved)
    return saved, weight, ctx.kernel


class MxMatmul(torch.autograd.Function):
    """x W^T with its three GEMMs in MXFP8, each operand blocked along the GEMM's contracted dimension."""

    @staticmethod
    def forward(ctx, x, weight, kernel: MxKernel, shard):
        rows = x.reshape(-1, x.shape[-1])
        y = torch.mm(kernel.cast(rows), kernel.cast(weight).t())
        return save_matmul_operands(ctx, x, weight, kernel, shard, y)

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight, kernel = saved_matmul_operands(ctx)
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(kernel.cast(g), kernel.cast(weight.t()).t()).reshape(ctx.x_shape)
        x = ctx.regather.gather(saved) if ctx.regather is not None else saved
        if ctx.needs_input_grad[1]:
            rows = _pad_rows(x.reshape(-1, x.shape[-1]))
            g_rows = _pad_rows(g)
            grad_w = torch.mm(kernel.cast(g_rows.t()), kernel.cast(rows.t()).t()).to(weight.dtype)
        return grad_x, grad_w, None, None
