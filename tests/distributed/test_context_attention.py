"""Context-parallel attention (parallel/context.py) against single-process full attention (gloo, CPU).

Every rank of a world of cp = 2 or 4 takes its zigzag part of the same q, k, v (fp32), runs one
method over the world's dp axis (standing in for cp) and its backward; the parts are put back in
sequence order here and compared with plain SDPA on the whole sequence under the whole
causal (+ document) mask, with k and v expanded to every head: output and the q, k, v gradients
within 1e-5. The packed documents have lengths that are no multiple of 2cp and cross chunk and
rank boundaries. The bytes each rank sends are checked against docs/context.md's formulas, and
the reference decoder run through its attention seam against the decoder on the whole sequence.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err

B, S, D = 2, 32, 8
DOC_LENGTHS = [[5, 11, 3, 9, 4], [13, 1, 7, 11]]  # one row each: 32 tokens, boundaries off the chunks
METHODS = ("ring", "allgather", "ulysses")
HEADS = ((8, 4), (4, 4))  # (q heads, kv heads): grouped-query and plain
CASES = [(m, mask, h, hk) for m in METHODS for mask in ("causal", "docs") for h, hk in HEADS]


def packed_docs() -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and per-document positions of two rows, packed by data/packing.py."""
    from threefold.data.packing import pack_documents

    docs = [[1] * n for row in DOC_LENGTHS for n in row]
    packed = pack_documents(docs, S)
    assert packed.tokens.shape == (B, S) and bool(packed.real.all())
    return packed.documents, packed.positions


def inputs(h: int, hk: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(h * 10 + hk)
    q, do = (torch.randn(B, h, S, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, hk, S, D, generator=gen) for _ in range(2))
    return q, k, v, do


def reference(q, k, v, do, docs):
    """Plain SDPA on the whole sequence, every head (k, v repeated), the whole boolean mask."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         attn_mask=mask[:, None])
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def run_attention(cases: list) -> dict:
    """On every rank: each case's local output and gradients, its bytes per direction, ring's blocks."""
    import torch.distributed as dist

    from threefold.comm.collectives import Comm
    from threefold.errors import UserError
    from threefold.mesh import Layout, Mesh
    from threefold.parallel.context import context_attention, ring_attention, zigzag_index, zigzag_split

    mesh = Mesh(Layout(dp=dist.get_world_size()), torch.device("cpu"))
    comm = Comm(mesh)
    cp, rank = mesh.size("dp"), mesh.rank("dp")
    docs_all, _ = packed_docs()
    index = zigzag_index(S, cp, rank)
    out = {}
    for method, mask, h, hk in cases:
        q, k, v, do = inputs(h, hk)
        ql, kl, vl = (zigzag_split(x, cp, rank, dim=2).requires_grad_() for x in (q, k, v))
        docs = zigzag_split(docs_all, cp, rank, dim=1) if mask == "docs" else None
        comm.traffic.take_window()
        y = context_attention(method, ql, kl, vl, comm, "dp", index, docs)
        forward = comm.traffic.take_window().get("dp", {})
        y.backward(zigzag_split(do, cp, rank, dim=2))
        backward = comm.traffic.take_window().get("dp", {})
        out[(method, mask, h, hk)] = {"out": y.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                                      "forward": forward, "backward": backward}
    blocks = {}
    for mask in ("causal", "docs"):
        stats = []
        q, k, v, _ = inputs(*HEADS[0])
        parts = (zigzag_split(x, cp, rank, dim=2) for x in (q, k, v))
        ring_attention(*parts, comm, "dp", index, zigzag_split(docs_all, cp, rank, 1) if mask == "docs" else None,
                       stats=stats)
        blocks[mask] = stats
    nccl = Comm(mesh, semantics="nccl")  # one Work per p2p batch, batches of an axis in issue order
    q, k, v, do = inputs(*HEADS[0])
    ql, kl, vl = (zigzag_split(x, cp, rank, dim=2).requires_grad_() for x in (q, k, v))
    y = context_attention("ring", ql, kl, vl, nccl, "dp", index, zigzag_split(docs_all, cp, rank, dim=1))
    y.backward(zigzag_split(do, cp, rank, dim=2))
    under_nccl = {"out": y.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    refusals = []
    for h, hk in ((cp + 1, 1), (2 * cp, cp // 2)):  # heads, then kv heads, not divisible by cp
        q, k, v, _ = inputs(h, hk)
        try:
            context_attention("ulysses", q[:, :, :S // cp], k[:, :, :S // cp], v[:, :, :S // cp], comm, "dp", index)
            refusals.append("")
        except UserError as e:
            refusals.append(str(e))
    return {"cases": out, "blocks": blocks, "refusals": refusals, "nccl": under_nccl}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def attention(request, worlds):
    cp = request.param
    return cp, worlds(cp).run(run_attention, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_full_attention(attention, case):
    from threefold.parallel.context import zigzag_unsplit

    cp, ranks = attention
    method, mask, h, hk = case
    docs = packed_docs()[0] if mask == "docs" else None
    expected = dict(zip(("out", "dq", "dk", "dv"), reference(*inputs(h, hk), docs)))
    for name, want in expected.items():
        got = zigzag_unsplit([r["cases"][case][name] for r in ranks], dim=2)
        err = rel_err(got, want)
        assert err <= 1e-5, f"cp={cp} {case}: {name} differs by {err:.2e}"


def test_ring_under_nccl_semantics(attention):
    """The ring's p2p batches in NCCL's order (Comm semantics="nccl"): the same result, no deadlock."""
    cp, ranks = attention
    case = ("ring", "docs", *HEADS[0])
    for name in ("out", "dq", "dk", "dv"):
        for r in ranks:
            assert torch.equal(r["nccl"][name], r["cases"][case][name])


def expected_bytes(method: str, cp: int, h: int, hk: int, packed: bool) -> tuple[dict, dict]:
    """docs/context.md's figures, written out here: s = S/cp local tokens, 4-byte elements."""
    s = S // cp
    kv = 2 * B * hk * s * D * 4  # one rank's K and V, bytes
    mask = (cp - 1) * B * s * 8 * (2 if packed else 1)  # int64 indices (and document ids) of every rank
    if method == "ring":
        return {"all_gather.mask": mask, "send": (cp - 1) * kv, "recv": 0}, {"send": 2 * (cp - 1) * kv, "recv": 0}
    if method == "allgather":
        return {"all_gather.mask": mask, "all_gather": (cp - 1) * kv}, {"reduce_scatter": (cp - 1) * kv}
    a2a = (cp - 1) * B * s * D * 4 * (2 * h + 2 * hk) // cp  # q, k, v there, the output back
    return {"all_gather.mask": mask, "all_to_all": a2a}, {"all_to_all": a2a}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_bytes_equal_theory(attention, case):
    from threefold.planner.context_comm import theoretical_bytes

    cp, ranks = attention
    method, mask, h, hk = case
    forward, backward = expected_bytes(method, cp, h, hk, mask == "docs")
    theory = theoretical_bytes(method, cp, B, h, hk, S // cp, D, 4, mask == "docs")
    assert theory == {"forward": forward, "backward": backward}
    for rank, r in enumerate(ranks):
        assert r["cases"][case]["forward"] == forward, f"rank {rank} forward"
        assert r["cases"][case]["backward"] == backward, f"rank {rank} backward"


def test_ring_skips_empty_blocks_and_balances_causal_work(attention):
    """Dense causal: each rank computes 3 sub-blocks of its own block (two diagonal, one whole) and
    2 of every other (the other two are in the future): 2cp + 1 of 4cp, the same on every rank, decided
    from the ranks alone. With documents the same blocks run (which document a key holds is on the device:
    skipping another document's block would read it back to the host inside attention)."""
    cp, ranks = attention
    causal = [len(r["blocks"]["causal"]) for r in ranks]
    assert causal == [2 * cp + 1] * cp
    assert [len(r["blocks"]["docs"]) for r in ranks] == [2 * cp + 1] * cp


def test_ulysses_refuses_heads_not_divisible(attention):
    cp, ranks = attention
    for r in ranks:
        heads, kv_heads = r["refusals"]
        assert heads.startswith("parallel.cp_method=ulysses:") and f"cp={cp}" in heads and "\n" not in heads
        assert kv_heads.startswith("parallel.cp_method=ulysses:") and "\n" not in kv_heads


def test_zigzag_round_trip_and_indices():
    from threefold.errors import UserError
    from threefold.parallel.context import zigzag_index, zigzag_split, zigzag_unsplit

    x = torch.randn(3, 24, 5)
    for cp in (1, 2, 3, 4, 6):
        parts = [zigzag_split(x, cp, r) for r in range(cp)]
        assert torch.equal(zigzag_unsplit(parts), x)
        c = 24 // (2 * cp)
        for r, part in enumerate(parts):
            index = zigzag_index(24, cp, r)
            assert index.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
            assert torch.equal(part, x[:, index])
        assert sorted(torch.cat([zigzag_index(24, cp, r) for r in range(cp)]).tolist()) == list(range(24))
    with pytest.raises(UserError, match="multiple of 2 x cp = 8"):
        zigzag_split(torch.zeros(1, 12), 4, 0)


# ---------------------------------------------------------------- the decoder through its attention seam

DECODER_CASES = [("ring", "causal"), ("allgather", "docs"), ("ulysses", "docs"), ("ring", "docs")]


class DocumentCore:
    """The whole-sequence reference core for packed rows: positions restart per document, SDPA under
    the causal + document mask."""

    def __init__(self, docs, positions):
        self.docs, self.positions = docs, positions

    def rotary_positions(self, seq, device):
        return self.positions

    def __call__(self, q, k, v):
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril() & (self.docs[:, :, None] == self.docs[:, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=k.shape[1] != q.shape[1])


def decoder_inputs():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (B, S), generator=gen), torch.randn(B, S, 256, generator=gen)


def run_decoder(cases: list) -> dict:
    """On every rank: the tiny Llama's local logits and its parameter gradients under each case."""
    import torch.distributed as dist

    from threefold.comm.collectives import Comm
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.parallel.context import ContextCore, zigzag_index, zigzag_split

    mesh = Mesh(Layout(dp=dist.get_world_size()), torch.device("cpu"))
    comm = Comm(mesh)
    cp, rank = mesh.size("dp"), mesh.rank("dp")
    cfg = load_config(None, ["model.preset=tiny-llama"]).model
    tokens, weights = decoder_inputs()
    docs, positions = packed_docs()
    index = zigzag_index(S, cp, rank)
    out = {}
    for method, mask in cases:
        if method == "ulysses" and cfg.kv_heads % cp:
            continue
        model = build_model(cfg, 0)
        packed = mask == "docs"
        core = ContextCore(method, comm, "dp", index, zigzag_split(docs, cp, rank, 1) if packed else None,
                           zigzag_split(positions, cp, rank, 1) if packed else None)
        for block in model.blocks:
            block.attn.attention_core = core
        logits = model(zigzag_split(tokens, cp, rank, 1))
        (logits * zigzag_split(weights, cp, rank, 1)).sum().backward()
        out[(method, mask)] = {"logits": logits.detach(),
                               "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_decoder_through_the_seam_matches_whole_sequence(worlds, cp):
    """RoPE at the global positions (per document when packed) and the cp attention in every block:
    the tiny Llama's logits, and its parameter gradients summed over cp ranks, equal the model's on
    the whole sequence."""
    from threefold.config import load_config
    from threefold.models.decoder import build_model
    from threefold.parallel.context import zigzag_unsplit

    ranks = worlds(cp).run(run_decoder, DECODER_CASES)
    cfg = load_config(None, ["model.preset=tiny-llama"]).model
    tokens, weights = decoder_inputs()
    docs, positions = packed_docs()
    for case in DECODER_CASES:
        if case not in ranks[0]:
            assert case[0] == "ulysses" and cfg.kv_heads % cp
            continue
        model = build_model(cfg, 0)
        if case[1] == "docs":
            for block in model.blocks:
                block.attn.attention_core = DocumentCore(docs, positions)
        logits = model(tokens)
        (logits * weights).sum().backward()
        got = zigzag_unsplit([r[case]["logits"] for r in ranks], dim=1)
        assert rel_err(got, logits.detach()) <= 1e-5, f"cp={cp} {case}: logits"
        for name, p in model.named_parameters():
            summed = sum(r[case]["grads"][name] for r in ranks)
            err = rel_err(summed, p.grad)
            assert err <= 1e-5, f"cp={cp} {case}: gradient of {name} differs by {err:.2e}"
