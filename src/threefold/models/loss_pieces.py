"""Sizes of the loss head's pieces and of the cross-entropy's fp32 chunks (models/loss.py,
models/cross_entropy.py), in plain arithmetic: the planner imports them without torch."""

from __future__ import annotations

# The cross-entropy's fp32 working memory: a chunk of logits upcast to fp32 and its exp, 8 bytes a logit.
FP32_BYTES_PER_LOGIT = 8
# Chunks are cut only when the working memory of all rows at once would exceed the larger of this
# floor and the logits' own bytes: the loss then at most doubles what the logits hold, in a
# handful of chunks (a loop of kernels per chunk costs host time and compile time).
CHUNK_FLOOR_BYTES = 1 << 27


def chunk_rows(rows: int, vocab: int, logit_bytes: int) -> int:
    """Token rows of (rows, vocab) logits of `logit_bytes` each that the cross-entropy upcasts at once.

    All of them (one chunk) when their fp32 working memory, 8 bytes a logit, fits the budget
    max(128 MiB, rows x vocab x logit_bytes); else the fewest equal chunks that fit it: 4 for bf16
    or fp16 logits, 2 for fp32, whatever the batch and the vocabulary (GPT-2 at 16 x 1024 tokens was
    cut into 50 chunks of 2^24 logits, a 1B Llama into 64)."""
    rows, vocab = max(1, rows), max(1, vocab)
    budget = max(CHUNK_FLOOR_BYTES, rows * vocab * logit_bytes)
    fit = max(1, budget // (FP32_BYTES_PER_LOGIT * vocab))
    if fit >= rows:
        return rows
    chunks = -(-rows // fit)
    return -(-rows // chunks)


def piece_tokens(rows: int, seq: int, chunk: int, sequence_sharded: bool = False) -> int:
    """Tokens of the largest piece `pieces` cuts a (rows, seq) micro-batch into (the planner's term)."""
    if chunk <= 0 or rows * seq <= chunk:
        return rows * seq
    if sequence_sharded or chunk >= seq:
        return min(rows, max(1, chunk // seq)) * seq
    return rows * min(seq, max(1, chunk // rows))


def loss_bytes_per_logit(logit_bytes: int, padded: bool = False) -> tuple[int, int]:
    """(forward, backward) HBM bytes per logit of models/cross_entropy.py's eager kernels (tp = 1) on a GPU,
    `logit_bytes` = c the logits' element size, as tests/unit/test_loss_bytes.py counts them.

    Forward: the row max (c); bf16/fp16: the upcast (c + 4), the fused softmax (three reads of fp32, one
    write: 16), softmax - one_hot written in the logits' dtype (4 + c); fp32: the softmax written straight
    into the gradient (16), after a copy of the rows (8) when the vocabulary is padded. Backward: the
    gradient scaled per row (c read, c written). bf16: 30 + 4 (torch's F.cross_entropy(logits.float()):
    22 + 26); fp32: 20 + 8, padded 28 + 8 (torch's F.cross_entropy: 16 + 20)."""
    c = logit_bytes
    if c == 4:
        return c + 16 + (8 if padded else 0), 2 * c
    return c + (c + 4) + 16 + (4 + c), 2 * c
