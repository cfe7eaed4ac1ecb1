"""Summed token cross-entropy over logits kept in their compute dtype, its gradient written in the forward.

Eager (the default everywhere): one pass of torch's fused softmax kernel per chunk of token rows
gives both the loss and the gradient, and backward only scales the gradient. Per chunk
(`loss_pieces.chunk_rows`: one chunk when the fp32 working memory of all rows fits max(128 MiB,
the logits' own bytes), else the fewest equal chunks that do):

* the rows in fp32 (bf16/fp16 logits: an upcast; fp32 logits: the rows themselves, or a copy when
  the vocabulary is padded), the padded columns set to -inf in that fp32 copy - a slice of V - valid
  columns written, never a mask over the logits - so the softmax gives them exactly 0;
* p = softmax(rows) by aten's fused kernel, in place in that fp32 copy; the loss of a token is
  lse - logit[target], with the fp32 log-sum-exp read off the softmax at the row's largest logit,
  lse = max - log p[argmax] (p[argmax] = 1 / sum exp(x - max) >= 1 / V: no underflow, fp32 accurate);
* p - one_hot(target) is written into the gradient buffer in the logits' dtype (fp32 logits: the
  softmax writes straight into it).

Backward multiplies that buffer by the incoming gradient per row (0 for an ignored target) in one
kernel, in fp32, written in the logits' dtype. Kept for backward: that buffer (the logits' bytes,
in place of the logits, which are no longer needed) and the targets. HBM bytes per logit by the
kernels' count (tests/unit/test_loss_bytes.py): 34 in bf16 (torch's F.cross_entropy(logits.float())
48), 28 in fp32 (36 with a padded vocabulary; torch's F.cross_entropy 36). bf16 rounds the gradient
twice (p - one_hot, then the scale); fp32 matches torch's to rounding.

Compiled (`torch.compile`): dynamo traces `F.cross_entropy` of the upcast valid columns instead, so
that inductor fuses the upcast, the log-sum-exp and the gradient into its own kernels.

Columns from `valid` on (a vocabulary padded to `model.vocab_multiple`) are not part of the
softmax and get zero gradient: the loss is the unpadded model's.

A target equal to `IGNORE_INDEX` (-100, torch's `F.cross_entropy` default) adds nothing to the sum
and its row gets zero gradient: packed rows (`data.pack`) mark so the targets of padding and of
each document's last token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loss_pieces import chunk_rows

IGNORE_INDEX = -100  # a target that does not count (torch's convention)


def _softmax_rows(rows: torch.Tensor, valid: int, out: torch.Tensor | None) -> torch.Tensor:
    """softmax(rows[:, :valid]) in fp32 over all columns (padded ones exactly 0). fp32 logits with `out`
    (the gradient buffer's rows): written into it; else into the fp32 upcast or copy of the rows, in place
    (aten's softmax kernels read a row before they write it), so the chunk holds one fp32 tensor."""
    padded = valid < rows.shape[-1]
    if rows.dtype == torch.float32 and out is not None and not padded:
        return torch.ops.aten._softmax.out(rows, -1, False, out=out)
    if rows.dtype == torch.float32 and not padded:
        return torch.softmax(rows, -1)
    if rows.dtype != torch.float32:
        x = rows.float()
    else:
        x = rows.clone() if out is None else out.copy_(rows)
    if padded:
        x[:, valid:] = -torch.inf
    return torch.ops.aten._softmax.out(x, -1, False, out=x)


def _loss_and_gradient(logits_nv: torch.Tensor, local_n: torch.Tensor, valid: int,
                       grad_nv: torch.Tensor | None) -> torch.Tensor:
    """Per-row lse - logit[target] in fp32; with `grad_nv`, softmax - one_hot(target) written into it."""
    n = logits_nv.shape[0]
    top, at = logits_nv[:, :valid].max(dim=-1)
    lse = torch.empty(n, dtype=torch.float32, device=logits_nv.device)
    step = chunk_rows(n, valid, logits_nv.element_size())
    for i in range(0, n, step):
        out = None if grad_nv is None else grad_nv[i:i + step]
        p = _softmax_rows(logits_nv[i:i + step], valid, out)
        lse[i:i + step] = top[i:i + step].float() - p.gather(-1, at[i:i + step, None]).squeeze(-1).log()
        if out is not None:
            p.scatter_add_(-1, local_n[i:i + step, None], torch.full((p.shape[0], 1), -1.0, device=p.device))
            if p is not out:
                out.copy_(p)
    return lse - logits_nv.gather(-1, local_n[:, None]).squeeze(-1).float()


def _summed(logits_nv: torch.Tensor, targets_n: torch.Tensor, valid: int, grad_nv: torch.Tensor | None) -> torch.Tensor:
    """The summed loss of the rows whose target counts (`_loss_and_gradient`, ignored rows at target 0)."""
    ignored = targets_n == IGNORE_INDEX
    per_row = _loss_and_gradient(logits_nv, targets_n.masked_fill(ignored, 0), valid, grad_nv)
    return per_row.masked_fill_(ignored, 0.0).sum()


class _SummedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_nv: torch.Tensor, targets_n: torch.Tensor, valid: int) -> torch.Tensor:
        grad = torch.empty(logits_nv.shape, dtype=logits_nv.dtype, device=logits_nv.device)
        ctx.save_for_backward(grad, targets_n)  # the caller's targets: the ignored rows found again
        return _summed(logits_nv, targets_n, valid, grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved, targets = ctx.saved_tensors
        rows = grad.float().expand(targets.shape[0]).masked_fill(targets == IGNORE_INDEX, 0.0)
        return _scaled(saved, rows), None, None


def _scaled(saved: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """saved * rows[:, None] computed in fp32, written in saved's dtype: one kernel on a GPU, which casts
    in registers (not in place: a retained graph may run backward again). A CPU's TensorIterator casts
    through fp32 temporaries of both operands: there an eighth of the rows at a time."""
    out = torch.empty_like(saved)
    n = saved.shape[0]
    step = n if saved.dtype == rows.dtype or saved.device.type != "cpu" else max(1, -(-n // 8))
    for i in range(0, n, step):
        torch.mul(saved[i:i + step], rows[i:i + step, None], out=out[i:i + step])
    return out


def softmax_minus_one_hot(logits_nv: torch.Tensor, local_targets_n: torch.Tensor, lse_n: torch.Tensor, valid: int,
                          grad: torch.Tensor, hit_n: torch.Tensor | None = None) -> torch.Tensor:
    """(softmax - one_hot(target)) * grad in the logits' dtype, computed in fp32 one chunk of rows at a time
    (the vocabulary-parallel loss's backward, parallel/tensor.py).

    `grad` is a scalar or one number per row; `hit_n` (optional) says which rows' targets fall in these
    columns (the vocabulary-parallel loss); columns from `valid` on get zero."""
    n, v = logits_nv.shape
    out = torch.empty((n, v), dtype=logits_nv.dtype, device=logits_nv.device)
    if valid < v:
        out[:, valid:] = 0
    step = chunk_rows(n, valid, logits_nv.element_size())
    for i in range(0, n if valid > 0 else 0, step):
        p = logits_nv[i:i + step, :valid].to(torch.float32, copy=True)
        p.sub_(lse_n[i:i + step].unsqueeze(-1)).exp_()
        minus = torch.full((p.shape[0], 1), -1.0, device=p.device)
        if hit_n is not None:
            minus = minus * hit_n[i:i + step].unsqueeze(-1)
        p.scatter_add_(-1, local_targets_n[i:i + step].unsqueeze(-1), minus)
        p.mul_(grad if grad.dim() == 0 else grad[i:i + step].unsqueeze(-1))
        out[i:i + step, :valid] = p
    return out


def summed_cross_entropy(logits_nv: torch.Tensor, targets_n: torch.Tensor, valid: int | None = None) -> torch.Tensor:
    """Sum over rows of -log softmax(logits[:, :valid])[target], in fp32, the logits kept in their dtype;
    rows whose target is IGNORE_INDEX add nothing."""
    valid = logits_nv.shape[-1] if valid is None else valid
    if torch.compiler.is_compiling():  # inductor fuses torch's own loss; no chunk loop to trace
        return F.cross_entropy(logits_nv[:, :valid].float(), targets_n, ignore_index=IGNORE_INDEX, reduction="sum")
    if torch.is_grad_enabled() and logits_nv.requires_grad:
        return _SummedCrossEntropy.apply(logits_nv, targets_n, valid)
    return _summed(logits_nv, targets_n, valid, None)  # no gradient wanted (evaluation): the loss alone
