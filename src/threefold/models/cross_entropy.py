"""Summed token cross-entropy over logits kept in their compute dtype.

`F.cross_entropy(logits.float())` copies all logits to fp32 and keeps fp32 log-probabilities
(4 b s V bytes) for backward. Here the logits stay in their dtype: forward upcasts one chunk of
token rows at a time (`loss_pieces.chunk_rows`: one chunk when the fp32 working memory of all
rows fits max(128 MiB, the logits' own bytes), else the fewest equal chunks that do) and keeps only the fp32
log-sum-exp of each token; backward recomputes softmax - one_hot chunk by chunk in fp32 and
writes it in the logits' dtype. Kept for backward: the logits (which exist anyway: b s V in the
compute dtype), the targets and 4 bytes per token. No extra matmul: the head is not recomputed.

Columns from `valid` on (a vocabulary padded to `model.vocab_multiple`) are not part of the
softmax and get zero gradient: the loss is the unpadded model's.

A target equal to `IGNORE_INDEX` (-100, torch's `F.cross_entropy` default) adds nothing to the sum
and its row gets zero gradient: packed rows (`data.pack`) mark so the targets of padding and of
each document's last token. With no such target the sum and the gradient are bitwise those of
the plain sum (the masks select nothing).
"""

from __future__ import annotations

import torch

from .loss_pieces import chunk_rows

IGNORE_INDEX = -100  # a target that does not count (torch's convention)


class _SummedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_nv: torch.Tensor, targets_n: torch.Tensor, valid: int) -> torch.Tensor:
        n = logits_nv.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits_nv.device)
        step = chunk_rows(n, valid, logits_nv.element_size())
        for i in range(0, n, step):
            lse[i:i + step] = torch.logsumexp(logits_nv[i:i + step, :valid].float(), dim=-1)
        ignored = targets_n == IGNORE_INDEX
        picked = logits_nv.gather(-1, targets_n.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits_nv, targets_n, lse)  # the caller's targets: the ignored rows found again
        ctx.valid = valid
        return (lse - picked).masked_fill_(ignored, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        ignored = targets == IGNORE_INDEX
        rows = grad.float().expand(targets.shape[0]).masked_fill(ignored, 0.0)  # ignored rows: no gradient
        return softmax_minus_one_hot(logits, targets.masked_fill(ignored, 0), lse, ctx.valid, rows), None, None


def softmax_minus_one_hot(logits_nv: torch.Tensor, local_targets_n: torch.Tensor, lse_n: torch.Tensor, valid: int,
                          grad: torch.Tensor, hit_n: torch.Tensor | None = None) -> torch.Tensor:
    """(softmax - one_hot(target)) * grad in the logits' dtype, computed in fp32 one chunk of rows at a time.

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
    return _SummedCrossEntropy.apply(logits_nv, targets_n, valid)
