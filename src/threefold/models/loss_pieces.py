"""The size of the loss head's pieces (models/loss.py), in plain arithmetic: the planner imports it
without torch."""

from __future__ import annotations


def piece_tokens(rows: int, seq: int, chunk: int, sequence_sharded: bool = False) -> int:
    """Tokens of the largest piece `pieces` cuts a (rows, seq) micro-batch into (the planner's term)."""
    if chunk <= 0 or rows * seq <= chunk:
        return rows * seq
    if sequence_sharded or chunk >= seq:
        return min(rows, max(1, chunk // seq)) * seq
    return rows * min(seq, max(1, chunk // rows))
