"""Sizes of the loss head's pieces and of the cross-entropy's fp32 chunks (models/loss.py,
models/cross_entropy.py), in plain arithmetic: the planner imports them without torch."""

from __future__ import annotations

# The cross-entropy upcasts at most this many logits to fp32 at once (64 MiB): rows of one chunk.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(vocab: int) -> int:
    """Token rows of (tokens, vocab) logits the cross-entropy upcasts to fp32 at once."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def piece_tokens(rows: int, seq: int, chunk: int, sequence_sharded: bool = False) -> int:
    """Tokens of the largest piece `pieces` cuts a (rows, seq) micro-batch into (the planner's term)."""
    if chunk <= 0 or rows * seq <= chunk:
        return rows * seq
    if sequence_sharded or chunk >= seq:
        return min(rows, max(1, chunk // seq)) * seq
    return rows * min(seq, max(1, chunk // rows))
