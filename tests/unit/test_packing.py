"""Packing whole documents into rows (data/packing.py): exact rows, ids, positions, padding."""

import random

import pytest
import torch

from threefold.data.packing import pack_documents


def test_rows_written_out():
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15], [], [16]]
    p = pack_documents(docs, 8, pad_id=0)
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13, 14, 15], [16, 0, 0, 0, 0, 0, 0, 0]]
    assert p.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert p.real.tolist() == [[True] * 7 + [False], [True] * 8, [True] + [False] * 7]


def test_a_document_longer_than_a_row_is_cut_into_rows():
    p = pack_documents([[7, 7], list(range(20, 31)), [5]], 4, pad_id=-1)
    assert p.tokens.tolist() == [[7, 7, -1, -1], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 5]]
    assert p.documents.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert p.positions.tolist() == [[0, 1, 0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_whole_documents_in_order_with_restarting_positions(seed):
    rng = random.Random(seed)
    length = 16
    docs = [[rng.randrange(1, 100) for _ in range(rng.randrange(1, length + 1))] for _ in range(40)]
    p = pack_documents(docs, length)
    assert p.tokens.dtype == p.documents.dtype == p.positions.dtype == torch.int64
    assert p.tokens[p.real].tolist() == [t for d in docs for t in d]  # nothing lost, reordered or duplicated
    seen = []
    for r in range(p.tokens.shape[0]):
        ids = p.documents[r]
        assert ids[0] == 0 and bool(((ids[1:] - ids[:-1]) >= 0).all()) and bool(((ids[1:] - ids[:-1]) <= 1).all())
        for d in ids.unique().tolist():
            where = ids == d
            assert p.positions[r][where].tolist() == list(range(int(where.sum())))  # restart per document
            if bool(p.real[r][where].all()):
                seen.append(p.tokens[r][where].tolist())
            else:
                assert not bool(p.real[r][where].any()) and d == int(ids.max())  # padding: the last id of its row
    assert seen == docs  # every document whole, in one row


def test_bad_length():
    with pytest.raises(ValueError):
        pack_documents([[1]], 0)
