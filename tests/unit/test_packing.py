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


def test_packed_rows_attend_by_document_in_one_process(alone):
    """Without cp (an axis of one rank) every method's document mask is the whole-row reference's:
    SDPA under causal & same-document, padding a document of its own."""
    import torch.nn.functional as F

    from threefold.comm.collectives import Comm
    from threefold.mesh import Layout, Mesh, init_distributed
    from threefold.parallel.context import METHODS, context_attention

    init_distributed(torch.device("cpu"))
    comm = Comm(Mesh(Layout(), torch.device("cpu")))
    p = pack_documents([[1] * n for n in (5, 2, 7, 9, 3, 4)], 12)
    b, s = p.tokens.shape
    gen = torch.Generator().manual_seed(0)
    q, do = torch.randn(b, 4, s, 8, generator=gen), torch.randn(b, 4, s, 8, generator=gen)
    k, v = torch.randn(b, 2, s, 8, generator=gen), torch.randn(b, 2, s, 8, generator=gen)
    mask = torch.ones(s, s, dtype=torch.bool).tril() & (p.documents[:, :, None] == p.documents[:, None, :])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(leaves[0], *(x.repeat_interleave(2, 1) for x in leaves[1:]),
                                          attn_mask=mask[:, None])
    want.backward(do)
    for method in METHODS:
        got_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        got = context_attention(method, *got_leaves, comm, "dp", torch.arange(s), p.documents)
        got.backward(do)
        assert (got - want).norm() <= 1e-5 * want.norm(), method
        for a, e in zip(got_leaves, leaves):
            assert (a.grad - e.grad).norm() <= 1e-5 * e.grad.norm(), method
    assert comm.traffic.total_bytes() == 0
