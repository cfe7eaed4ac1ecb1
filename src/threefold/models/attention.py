"""Attention on the fused kernels: blocks that return their log-sum-exp, merged by it.

The fused SDPA kernels return, beside the output, the log-sum-exp of every query row; two partial
attentions over disjoint key sets merge exactly from it, and the fused backward of one block, given
the merged output and log-sum-exp, is that block's share of the whole gradient (what torch's own
context parallelism does, torch.distributed.tensor.experimental). So an attention whose mask is a
union of rectangular blocks, each fully visible or causal (a square on the diagonal), runs on the
flash-class kernels with no mask tensor and no read back to the host:

    block_forward / block_backward   one block through the fused op of the device: on CUDA
                                     aten._scaled_dot_product_flash_attention (fp16/bf16, no mask)
                                     or _scaled_dot_product_efficient_attention (fp32, or a mask);
                                     elsewhere aten._scaled_dot_product_flash_attention_for_cpu
    merge                            two partial attentions over disjoint keys, by log-sum-exp (fp32)
    block_attention                  a differentiable attention over a fixed list of `Block`s
    window_blocks                    the blocks of a sliding window (query i sees i - w < j <= i): per
                                     chunk of w queries, the causal diagonal, and in the chunk before
                                     a strictly-upper triangle, which is causal once both are reversed

Which blocks are visible is decided from sizes and ranks alone (host integers), never from a tensor.
`attention_path` names, once per run, the path the model's attention takes (the run's summary line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to `heads` (grouped-query attention; the fused ops take equal heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], 1)


def _fold(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: each group of query heads summed into its key/value head."""
    return dx if dx.shape[1] == kv_heads else dx.unflatten(1, (kv_heads, -1)).sum(2)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive bias the fused ops take (0 or -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, causal: bool, scale: float, bias: torch.Tensor | None = None):
    """One block: q (b, h, sq, d) on k, v (b, hk, sk, d) -> (out in q's dtype, lse (b, h, sq) fp32, aux).

    `causal`: a square block on the diagonal (key j visible to query i when j <= i); `bias`: an
    additive mask broadcastable to (b, h, sq, sk) (the boolean-mask fallback; None on the fused path).
    `aux` is what the block's backward needs from its forward."""
    h = q.shape[1]
    ke, ve = _expand(k, h), _expand(v, h)
    if q.device.type == "cuda":
        if bias is None and q.dtype in _HALF:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, ke, ve, 0.0, causal, scale=scale)
            return out, lse, ("flash", (cum_q, cum_k, max_q, max_k, seed, offset))
        if bias is not None:
            bias = bias.expand(q.shape[0], h, q.shape[2], k.shape[2])
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, ke, ve, bias, True, 0.0, causal,
                                                                              scale=scale)
        return out, _empty_rows(lse[..., :q.shape[2]], bias), ("efficient", (bias, seed, offset, lse.shape[-1]))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, causal, attn_mask=bias, scale=scale)
    return out, _empty_rows(lse, bias), ("cpu", bias)


def _empty_rows(lse: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The log-sum-exp -inf on the rows the mask leaves empty (the kernels give 0 there), on the device."""
    if bias is None:
        return lse
    return torch.where(torch.isinf(bias).all(-1), float("-inf"), lse)


def block_backward(do, q, k, v, out, lse, causal: bool, scale: float, aux):
    """dq, dk, dv of one block, given the MERGED output `out` (q's dtype) and log-sum-exp `lse` of its rows."""
    h, hk = q.shape[1], k.shape[1]
    ke, ve = _expand(k, h), _expand(v, h)
    kind, extra = aux
    if kind == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            do, q, ke, ve, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    elif kind == "efficient":
        bias, seed, offset, width = extra
        padded = torch.nn.functional.pad(lse, (0, width - lse.shape[-1]))  # the op's rows, padded to its tile
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, ke, ve, bias, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, out, lse, 0.0, causal, attn_mask=extra, scale=scale)
    return dq, _fold(dk, hk), _fold(dv, hk)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def merge(out, lse, block_out, block_lse):
    """Log-sum-exp merge (fp32) of two partial attentions over disjoint key sets; a row that the block
    leaves empty (lse -inf) keeps what it had."""
    new = torch.logaddexp(lse, block_lse)
    safe = _safe(new)
    weight = torch.exp(block_lse - safe)[..., None]
    block_out = torch.where(weight > 0, block_out.float(), 0.0)  # an empty row's output may be NaN
    return out * torch.exp(lse - safe)[..., None] + block_out * weight, new


@dataclass(frozen=True)
class Block:
    """Query rows x key columns of one attention block: fully visible, or causal (a square on the
    diagonal); `reverse`: rows and columns both taken in reverse order (a strictly-upper triangle
    becomes causal); `bias`: an additive mask of the block (the mask fallback only)."""

    rows: slice
    cols: slice
    causal: bool = False
    reverse: bool = False
    bias: torch.Tensor | None = None


def _take(x: torch.Tensor, span: slice, reverse: bool) -> torch.Tensor:
    part = x[..., span, :] if x.dim() == 4 else x[..., span]
    return part.flip(-2 if x.dim() == 4 else -1) if reverse else part


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, scale):
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        auxes = []
        for blk in blocks:
            o, l, aux = block_forward(_take(q, blk.rows, blk.reverse), _take(k, blk.cols, blk.reverse),
                                      _take(v, blk.cols, blk.reverse), blk.causal, scale, blk.bias)
            o, l = (o.flip(-2), l.flip(-1)) if blk.reverse else (o, l)
            out[..., blk.rows, :], lse[..., blk.rows] = merge(out[..., blk.rows, :], lse[..., blk.rows], o, l)
            auxes.append(aux)
        result = out.to(q.dtype)
        ctx.blocks, ctx.auxes, ctx.scale = blocks, auxes, scale
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        for blk, aux in zip(ctx.blocks, ctx.auxes):
            r, c, rev = blk.rows, blk.cols, blk.reverse
            dq_b, dk_b, dv_b = block_backward(_take(grad, r, rev), _take(q, r, rev), _take(k, c, rev),
                                              _take(v, c, rev), _take(out, r, rev), _take(lse, r, rev).contiguous(),
                                              blk.causal, ctx.scale, aux)
            if rev:
                dq_b, dk_b, dv_b = dq_b.flip(-2), dk_b.flip(-2), dv_b.flip(-2)
            dq[..., r, :] += dq_b
            dk[..., c, :] += dk_b
            dv[..., c, :] += dv_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_attention(q, k, v, blocks: list[Block], scale: float | None = None) -> torch.Tensor:
    """Attention of q (b, h, sq, d) on k, v (b, hk, sk, d) over the union of `blocks` (each query row
    must be covered by at least one block), on the fused kernels; differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockAttention.apply(q, k, v, blocks, scale)


def window_blocks(seq: int, window: int) -> list[Block]:
    """The blocks of causal attention within a sliding window (query i sees key j when i - window < j
    <= i): chunks of `window` queries; chunk c (rows c*w .. c*w + m) sees its own chunk causally and,
    of chunk c - 1, the keys b > a of each query a (in-chunk offsets): those b >= m whole, and the
    strictly-upper m x m triangle, causal once reversed (query a < m - 1 against keys 1 .. m - 1)."""
    w, blocks = window, []
    for start in range(0, seq, w):
        m = min(w, seq - start)
        blocks.append(Block(slice(start, start + m), slice(start, start + m), causal=True))
        if start == 0:
            continue
        prev = start - w
        if m < w:
            blocks.append(Block(slice(start, start + m), slice(prev + m, start)))
        if m > 1:
            blocks.append(Block(slice(start, start + m - 1), slice(prev + 1, prev + m), causal=True, reverse=True))
    return blocks


def window_attention(q, k, v, window: int, scale: float | None = None) -> torch.Tensor:
    """Sliding-window causal attention (the library's banded mask) on the fused kernels, with no mask."""
    seq = q.shape[2]
    return block_attention(q, k, v, window_blocks(seq, window), scale)


def document_kernel(device: torch.device | str):
    """The packed documents' flash-class kernel of a device, chosen once (when the attention is wired):
    FlexAttention, compiled, on CUDA; None elsewhere - SDPA under the boolean mask, the CPU fallback
    (FlexAttention has no backward on CPU)."""
    if torch.device(device).type != "cuda":
        return None
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_attention(q, k, v, q_index, k_index, q_docs, k_docs, scale: float | None, kernel) -> torch.Tensor:
    """Causal + same-document attention through `kernel` (FlexAttention) under a block mask built on the
    device from the tokens' global indices and document ids, (b, sq) and (b, sk): no dense mask reaches
    the kernel, fully masked tiles are skipped, and nothing is read back to the host."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, qi, ki):
        return (k_index[b, ki] <= q_index[b, qi]) & (k_docs[b, ki] == q_docs[b, qi])

    block = create_block_mask(visible, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return kernel(q, k, v, block_mask=block, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def attention_path(device: torch.device | str, *, cp_method: str | None = None, packed: bool = False,
                   window: bool = False) -> str:
    """The one line naming the attention path of a run, from the device and the model's features: the
    choice the attention makes (`document_kernel` at wiring, the blocks from sizes and ranks)."""
    cuda = torch.device(device).type == "cuda"
    if packed:
        if cp_method == "ring":
            return ("attention: packed documents, ring, fused blocks under a document bias "
                    + ("(efficient attention)" if cuda else "(CPU fallback)"))
        return ("attention: packed documents, flex attention (document block mask)" if cuda
                else "attention: packed documents, boolean mask (CPU fallback)")
    if cp_method == "ring":
        return "attention: ring, fused blocks merged by log-sum-exp"
    if cp_method == "allgather":
        return "attention: all-gathered keys, fused blocks merged by log-sum-exp"
    if cp_method == "ulysses":
        return "attention: ulysses, sdpa is_causal" + (" (flash)" if cuda else "")
    if window:
        return "attention: sliding window, fused causal blocks merged by log-sum-exp"
    return "attention: sdpa is_causal" + (" (flash)" if cuda else "")
