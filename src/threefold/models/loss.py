"""The loss head: output projection and summed token cross-entropy, whole or in pieces of tokens.

Whole (`model.loss_chunk = 0`, the default): the logits of the whole micro-batch (b, s, V) in the
compute dtype, then the cross-entropy of models/cross_entropy.py, which upcasts one chunk of tokens
at a time to fp32, writes softmax - one_hot in the logits' dtype in its forward and keeps for
backward only that (bf16: 2 b s V bytes, in place of the logits, where
`F.cross_entropy(logits.float())` keeps 4 b s V). It costs no extra flops.

In pieces (`model.loss_chunk = n` tokens): the micro-batch is cut into pieces of at most n
tokens, and each piece's head and loss run as one checkpointed region (torch.utils.checkpoint,
non-reentrant). A piece's logits live only while its loss is computed; backward recomputes them
piece by piece. Nothing of vocabulary size is kept for backward and the peak holds one piece's
logits, at the price of a second head forward (2 h V flops per token). The loss is the same
sum, added piece by piece (equal to the whole loss to rounding, ~1e-7 relative in fp32).

Pieces run along the sequence when the head's input is whole along it; under sequence
parallelism (the head's input holds 1/tp of the sequence and the head gathers it) they run along
the batch rows, so that every piece's targets are whole rows. The tensor-parallel head and its
vocabulary-parallel loss run unchanged inside each piece (their collectives run again, in the same
order on every rank, when backward recomputes the piece).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cross_entropy import summed_cross_entropy
from .loss_pieces import piece_tokens  # noqa: F401  (the size `pieces` cuts; torch-free for the planner)

Head = Callable[[torch.Tensor], torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def head_loss(head: Head, loss: Loss, x_bsh: torch.Tensor, targets_bs: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Summed token loss of `loss(head(x_bsh), targets_bs)`, in pieces of at most `chunk` tokens (0: whole)."""
    rows, seq = targets_bs.shape
    if chunk <= 0 or rows * seq <= chunk:
        return loss(head(x_bsh), targets_bs)
    total = None
    for xs, ts in pieces(x_bsh, targets_bs, chunk):
        if torch.is_grad_enabled():
            part = checkpoint(_piece, head, loss, xs, ts, use_reentrant=False, preserve_rng_state=False)
        else:
            part = _piece(head, loss, xs, ts)
        total = part if total is None else total + part
    return total


def _piece(head: Head, loss: Loss, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
    return loss(head(x_bsh), targets_bs)


def pieces(x_bsh: torch.Tensor, targets_bs: torch.Tensor, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, targets) pieces of at most `chunk` tokens (at least one row of one token each; whole rows
    when the input is sequence-sharded)."""
    rows, seq = targets_bs.shape
    if x_bsh.shape[1] != seq or chunk >= seq:  # whole rows
        step = max(1, chunk // seq)
        return [(x_bsh[i:i + step], targets_bs[i:i + step]) for i in range(0, rows, step)]
    step = max(1, chunk // rows)  # every row, a stretch of the sequence
    return [(x_bsh[:, i:i + step], targets_bs[:, i:i + step]) for i in range(0, seq, step)]


class TokenCrossEntropy(nn.Module):
    """Sum over tokens of -log p(target); the trainer divides by the global token count.

    `vocab`: the real vocabulary when the logits have padded columns beyond it (`model.vocab_multiple`):
    those never count. None: every column is a token."""

    def __init__(self, vocab: int | None = None):
        super().__init__()
        self.vocab = vocab

    def forward(self, logits_bsv, targets_bs):
        return summed_cross_entropy(logits_bsv.flatten(0, 1), targets_bs.flatten(), self.vocab)
