"""Context-parallel attention reads nothing back to the host (gloo, CPU, cp = 2).

Each rank runs ring, allgather and ulysses attention, forward and backward, on its zigzag part of
a causal sequence and of packed documents, under the dispatcher count of tests/attention_watch.py:
no host read (`aten._local_scalar_dense`, `item`, `is_nonzero`) on any of them; without documents
no mask or bias reaches a kernel and every kernel is a fused one (the flash kernel on CPU). With
documents on CPU the mask is the fallback: it may reach the kernel, the host reads stay at 0.
Parity of these methods is tests/distributed/test_context_attention.py's."""

import pytest
import torch

S, D = 16, 8
DOC_LENGTHS = [5, 2, 7, 9, 3, 6]  # packed in rows of 16 tokens, boundaries off the chunks


def run_watched(methods: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    from threefold.comm.collectives import Comm
    from threefold.data.packing import pack_documents
    from threefold.mesh import Layout, Mesh
    from threefold.parallel.context import context_attention, zigzag_index, zigzag_split

    from tests.attention_watch import AttentionWatch

    mesh = Mesh(Layout(dp=dist.get_world_size()), torch.device("cpu"))
    comm = Comm(mesh)
    cp, rank = mesh.size("dp"), mesh.rank("dp")
    packed = pack_documents([[1] * n for n in DOC_LENGTHS], S)
    b = packed.tokens.shape[0]
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(b, 4, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, 2, S, D, generator=gen) for _ in range(2))
    index = zigzag_index(S, cp, rank)
    seen = {}
    for method in methods:
        for packed_rows in (False, True):
            leaves = [zigzag_split(x, cp, rank, dim=2).requires_grad_() for x in (q, k, v)]
            docs = zigzag_split(packed.documents, cp, rank, dim=1) if packed_rows else None
            watch = AttentionWatch()
            with watch:
                y = context_attention(method, *leaves, comm, "dp", index, docs)
                y.backward(zigzag_split(do, cp, rank, dim=2))
            seen[(method, packed_rows)] = {"reads": watch.reads, "masks": watch.masks, "unfused": watch.unfused(),
                                           "kernels": watch.kernels}
    return seen


@pytest.fixture(scope="module")
def watched(worlds):
    return worlds(2).run(run_watched, ("ring", "allgather", "ulysses"))


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_no_host_read_and_no_mask_on_the_fused_path(watched, method):
    for rank, seen in enumerate(watched):
        causal = seen[(method, False)]
        assert causal["reads"] == [], f"{method} rank {rank}: host reads {causal['reads']}"
        assert causal["masks"] == [], f"{method} rank {rank}: a mask reached {causal['masks']}"
        assert causal["unfused"] == [] and causal["kernels"], f"{method} rank {rank}: {causal['kernels']}"
        assert any(k.endswith("_backward") for k in causal["kernels"]), f"{method}: no fused backward"


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_packed_documents_read_nothing_back_either(watched, method):
    for rank, seen in enumerate(watched):
        assert seen[(method, True)]["reads"] == [], f"{method} rank {rank}: host reads {seen[(method, True)]['reads']}"
