"""Packing whole documents into fixed-length sequences, with document ids and positions.

`pack_documents(docs, length)` fills rows of `length` tokens with documents in their given order,
a document never split between rows unless it is longer than a row: such a document is cut
into pieces of `length` tokens (the last piece shorter), each piece a document of its own that
starts a fresh row. A document that does not fit in what is left of the current row starts the
next one; the rest of the row is padding (`pad_id`), which is one more document of its own, so
attention masked by document keeps it away from every real token.

Per row the document ids count 0, 1, 2, ... in order (padding last); positions restart at 0 in
every document (rotary or learned positions of a family that restarts them per document). The
attention mask is then causal within equal ids (parallel/context.py `attention_mask`), whatever
the documents' lengths and however a context-parallel split cuts them.

Pure: no tokenizer, no files, no torch randomness; `length` is the row as the sampler reads it
(train.seq_len + 1: the inputs are a row's first seq_len tokens, the targets its last seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Packed:
    tokens: torch.Tensor  # (rows, length) int64
    documents: torch.Tensor  # (rows, length) int64: 0, 1, ... per row, padding one more id
    positions: torch.Tensor  # (rows, length) int64: 0 .. len-1 within each document (padding too)
    real: torch.Tensor  # (rows, length) bool: False on padding


def _pieces(docs: Iterable[Sequence[int]], length: int):
    for doc in docs:
        doc = np.asarray(doc, dtype=np.int64)
        for start in range(0, len(doc), length):
            yield doc[start:start + length]


def pack_documents(docs: Iterable[Sequence[int]], length: int, pad_id: int = 0) -> Packed:
    """Whole documents (token id sequences) packed into rows of `length` tokens (module text)."""
    if length < 1:
        raise ValueError(f"rows need at least one token, not {length}")
    rows: list[list[np.ndarray]] = []
    used = length  # tokens in the current row: a full one forces a new row first
    for piece in _pieces(docs, length):
        if not len(piece):
            continue  # an empty document packs nothing
        if used + len(piece) > length:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece)
    n = len(rows)
    tokens = np.full((n, length), pad_id, dtype=np.int64)
    documents = np.zeros((n, length), dtype=np.int64)
    positions = np.zeros((n, length), dtype=np.int64)
    real = np.zeros((n, length), dtype=bool)
    for r, row in enumerate(rows):
        at = 0
        for d, piece in enumerate(row):
            tokens[r, at:at + len(piece)] = piece
            documents[r, at:at + len(piece)] = d
            positions[r, at:at + len(piece)] = np.arange(len(piece))
            real[r, at:at + len(piece)] = True
            at += len(piece)
        documents[r, at:] = len(row)
        positions[r, at:] = np.arange(length - at)
    return Packed(torch.from_numpy(tokens), torch.from_numpy(documents), torch.from_numpy(positions),
                  torch.from_numpy(real))
