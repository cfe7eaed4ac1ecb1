"""Context parallelism: the sequence of every micro-batch split over the ranks of one mesh axis.

Every function takes the axis by name (`axis`), so it runs on any axis of the Mesh; all bytes go
through `Comm` and are counted there (docs/context.md has the figures per method).

Zigzag split (causal load balance). The sequence of S tokens is cut into 2 cp chunks; rank i
holds chunks i and 2cp-1-i, in that order, so every rank holds one early and one late chunk and
does the same causal attention work. `zigzag_index` gives the global sequence index of each local
token: the causal mask and (for one document per sequence) the rotary positions.

Masks. Token q attends to token k when k's global index is not after q's and, with packed
documents, both carry the same document id (`docs`, any lengths, crossing chunk and rank
boundaries). `attention_mask` builds it from the indices and ids; every method gathers the ranks'
indices and ids once (`all_gather.mask`, small int64 tensors) and builds the masks it needs from
them, so no method assumes the zigzag layout for correctness.

Methods (each a differentiable function of local q (b, heads, s, d), k and v (b, kv_heads, s, d)
returning the local output (b, heads, s, d); GQA: kv_heads divides heads):

    ring       K and V rotate around the axis by p2p (`Comm.batch_send_recv`), the next block's
               transfer posted before the current block's attention so the two overlap; each
               block's partial attention (hand-written, fp32) is merged by log-sum-exp. Every
               block is cut into 2 x 2 sub-blocks (the local sequence is two zigzag chunks) and
               a sub-block the mask leaves empty is skipped: causally, the future ones, and with
               documents, those of other documents. Backward rotates K and V again and the fp32
               dK/dV of each block travel with it, one hop behind, and go home at the end.
    allgather  K and V all-gathered (one call), attention with the causal+document mask through
               `F.scaled_dot_product_attention`; backward reduce-scatters their gradients.
    ulysses    all-to-all from sequence-sharded to head-sharded q, k, v; full-sequence attention
               on heads/cp heads; all-to-all back. Heads and kv heads must divide by cp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..comm.autograd import all_gather_from_group, gather_along
from ..comm.collectives import Comm
from ..errors import UserError
from ..models.decoder import Attention, Embedding
from ..models.hf_causal import HFBlock
from ..models.hf_gpt2 import GPT2Block, GPT2Embedding
from ..planner.context_comm import theoretical_bytes  # noqa: F401  (the one formula; the runtime's tests read it here)

METHODS = ("ring", "allgather", "ulysses")

# ------------------------------------------------------------------ zigzag


def _check_split(seq: int, cp: int) -> None:
    if seq % (2 * cp):
        raise UserError(f"parallel.cp: the sequence length {seq} is not a multiple of 2 x cp = {2 * cp} "
                        f"(zigzag chunks); choose train.seq_len divisible by {2 * cp}")


def zigzag_index(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global indices (int64, seq / cp of them) of the tokens rank `rank` of `cp` holds."""
    _check_split(seq, cp)
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((first, last))


def zigzag_split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `x` along `dim` (the sequence): chunks rank and 2cp-1-rank of 2cp."""
    _check_split(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim)


def zigzag_unsplit(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole tensor again from every rank's part (rank order): the inverse of `zigzag_split`."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, last = part.chunk(2, dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, last
    return torch.cat(chunks, dim)


def zigzag_gather(x: torch.Tensor, comm: Comm, axis: str, dim: int = 1) -> torch.Tensor:
    """Every rank's part of `x` gathered over `axis` and put back in sequence order (not
    differentiable; evaluation and tests)."""
    cp = comm.mesh.size(axis)
    return zigzag_unsplit(gather_along(comm, x, axis, dim).chunk(cp, dim), dim)


# ------------------------------------------------------------------ masks


def attention_mask(q_index: torch.Tensor, k_index: torch.Tensor, q_docs: torch.Tensor | None = None,
                   k_docs: torch.Tensor | None = None) -> torch.Tensor:
    """(b, sq, sk) bool: query i may attend key j (j's index not after i's, same document)."""
    allowed = k_index[..., None, :] <= q_index[..., :, None]
    if q_docs is not None:
        allowed = allowed & (k_docs[..., None, :] == q_docs[..., :, None])
    return allowed


@dataclass(frozen=True)
class _Where:
    """Every rank's token indices and document ids, gathered once: (cp, b, s) each (docs or None)."""

    index: torch.Tensor
    docs: torch.Tensor | None

    def local_mask(self, rank: int, src: int) -> torch.Tensor:
        docs = self.docs
        return attention_mask(self.index[rank], self.index[src], None if docs is None else docs[rank],
                              None if docs is None else docs[src])

    def flat(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Indices and ids of the whole sequence in gathered (rank) order: (b, cp * s)."""
        def cat(t):
            return t.permute(1, 0, 2).flatten(1)
        return cat(self.index), None if self.docs is None else cat(self.docs)


def _gather_where(comm: Comm, axis: str, q: torch.Tensor, index: torch.Tensor,
                  docs: torch.Tensor | None) -> _Where:
    b, s = q.shape[0], q.shape[2]
    rows = [index.to(torch.int64).expand(b, s)]
    if docs is not None:
        rows.append(docs.to(torch.int64).expand(b, s))
    local = torch.stack(rows, 0).to(q.device).contiguous()  # (m, b, s)
    every = gather_along(comm, local[None], axis, 0, tag="mask")  # (cp, m, b, s)
    return _Where(every[:, 0], every[:, 1] if docs is not None else None)


# ------------------------------------------------------------------ ring


def _halves(n: int) -> list[slice]:
    h = (n + 1) // 2
    return [slice(0, h), slice(h, n)] if n > 1 else [slice(0, n)]


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _block_forward(q, k, v, allowed, scale):
    """Partial attention of q (b, hk, g, sq, d) on one key block k, v (b, hk, sk, d): (out, lse)."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - _safe(lse)[..., None])
    return torch.einsum("bhgqk,bhkd->bhgqd", p, v), lse


def _merge(out, lse, block_out, block_lse):
    """Log-sum-exp merge of two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, block_lse)
    safe = _safe(new)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def _block_backward(q, k, v, do, lse, delta, allowed, scale):
    """Gradients of one block: (dq, dk, dv) for q (b, hk, g, sq, d) and k, v (b, hk, sk, d)."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.exp(scores - _safe(lse)[..., None])
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q) * scale
    return dq, dk, dv


def _sub_blocks(allowed: torch.Tensor):
    """The (query rows, key columns, mask) sub-blocks of a block that the mask does not leave empty."""
    sq, sk = allowed.shape[-2:]
    for rows in _halves(sq):
        for cols in _halves(sk):
            sub = allowed[:, rows, cols]
            if bool(sub.any()):
                yield rows, cols, sub


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, axis, where, scale, stats):
        cp, rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        nxt_rank, prev_rank = (rank + 1) % cp, (rank - 1) % cp
        b, h, s, d = q.shape
        hk = k.shape[1]
        qf = q.float().unflatten(1, (hk, h // hk))
        out = qf.new_zeros(qf.shape)
        lse = qf.new_full(qf.shape[:-1], float("-inf"))
        kv = torch.stack((k, v)).contiguous()
        plan = []  # per step, the sub-blocks computed (backward takes the same ones)
        for t in range(cp):
            src = (rank - t) % cp
            pending = []
            if t < cp - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                pending = comm.batch_send_recv([(kv, axis, nxt_rank)], [(incoming, axis, prev_rank)])
            kf, vf = kv[0].float(), kv[1].float()
            plan.append(list(_sub_blocks(where.local_mask(rank, src))))
            for rows, cols, sub in plan[-1]:
                o_b, l_b = _block_forward(qf[..., rows, :], kf[:, :, cols], vf[:, :, cols], sub, scale)
                out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o_b, l_b)
                stats.append((t, rows.start, cols.start))
            for handle in pending:
                handle.wait()
            if pending:
                kv = incoming
        ctx.comm, ctx.axis, ctx.plan, ctx.scale = comm, axis, plan, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.flatten(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, axis, plan, scale = ctx.comm, ctx.axis, ctx.plan, ctx.scale
        cp, rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        nxt_rank, prev_rank = (rank + 1) % cp, (rank - 1) % cp
        hk = k.shape[1]
        qf = q.float().unflatten(1, (hk, q.shape[1] // hk))
        do = grad.float().unflatten(1, (hk, q.shape[1] // hk))
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack((k, v)).contiguous()
        own = None  # dK, dV of this rank's own block from its own queries
        arriving, acc_pending, sending = None, [], None
        for t in range(cp):
            pending = []
            if t < cp - 1:
                incoming = torch.empty_like(kv)
                pending = comm.batch_send_recv([(kv, axis, nxt_rank)], [(incoming, axis, prev_rank)])
            kf, vf = kv[0].float(), kv[1].float()
            dkv = torch.zeros((2,) + kf.shape, dtype=torch.float32, device=kf.device)
            for rows, cols, sub in plan[t]:
                dq_b, dk_b, dv_b = _block_backward(qf[..., rows, :], kf[:, :, cols], vf[:, :, cols],
                                                   do[..., rows, :], lse[..., rows], delta[..., rows], sub, scale)
                dq[..., rows, :] += dq_b
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if t == 0:
                own = dkv
            else:
                # the accumulator of block src: the queries of ranks src+1 .. rank-1 so far, one hop behind
                for handle in acc_pending:
                    handle.wait()
                if arriving is not None:
                    dkv += arriving
                sending, arriving = dkv, torch.empty_like(dkv)
                acc_pending = comm.batch_send_recv([(sending, axis, nxt_rank)], [(arriving, axis, prev_rank)])
            for handle in pending:
                handle.wait()
            if pending:
                kv = incoming
        for handle in acc_pending:  # the last arrival is this rank's own block, home from the others
            handle.wait()
        if arriving is not None:
            own = own + arriving
        dq = dq.flatten(1, 2).to(q.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


# ------------------------------------------------------------------ ulysses


def _seq_to_heads(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """(b, h, s, d) with the sequence sharded -> (b, h/cp, cp*s, d) with the heads sharded."""
    cp = comm.mesh.size(axis)
    b, h, s, d = x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # block j: heads of rank j
    out = torch.empty_like(blocks)
    comm.all_to_all(out, blocks, axis)  # block i: rank i's tokens of this rank's heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(y: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (b, h/cp, cp*s, d) -> (b, h, s, d)."""
    cp = comm.mesh.size(axis)
    b, hc, n, d = y.shape
    s = n // cp
    blocks = y.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # block j: rank j's tokens
    out = torch.empty_like(blocks)
    comm.all_to_all(out, blocks, axis)  # block i: this rank's tokens of rank i's heads
    return out.transpose(0, 1).reshape(b, cp * hc, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _seq_to_heads(x, comm, axis)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.comm, ctx.axis), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _heads_to_seq(y, comm, axis)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.comm, ctx.axis), None, None


def check_ulysses(heads: int, kv_heads: int, cp: int) -> None:
    """One line when ulysses cannot split the heads over cp."""
    if heads % cp or kv_heads % cp:
        raise UserError(f"parallel.cp_method=ulysses: {heads} query heads and {kv_heads} key/value heads must both "
                        f"be divisible by cp={cp}; choose a cp dividing both or parallel.cp_method=ring or allgather")


# ------------------------------------------------------------------ the three methods


def _sdpa(q, k, v, allowed, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def ring_attention(q, k, v, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                   scale: float | None = None, stats: list | None = None) -> torch.Tensor:
    """Causal (+ document) attention of the local queries on every rank's keys, by ring rotation.

    `index`: the global sequence index of each local token, (s,) or (b, s); `docs`: their
    document ids (b, s) or None (one document). `stats`, when given, receives (step, query
    half, key half) for every sub-block computed in the forward (the load balance)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    where = _gather_where(comm, axis, q, index, docs)
    return _RingAttention.apply(q, k, v, comm, axis, where, scale, [] if stats is None else stats)


def allgather_attention(q, k, v, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """Attention on all-gathered keys and values (their gradients reduce-scattered in backward)."""
    where = _gather_where(comm, axis, q, index, docs)
    kv = all_gather_from_group(torch.stack((k, v)), comm, axis, dim=3)  # (2, b, hk, cp*s, d), rank order
    k_index, k_docs = where.flat()
    rank = comm.mesh.rank(axis)
    allowed = attention_mask(where.index[rank], k_index, None if docs is None else where.docs[rank], k_docs)
    return _sdpa(q, kv[0], kv[1], allowed, scale)


def ulysses_attention(q, k, v, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """All-to-all to whole sequences of heads/cp heads, attention, all-to-all back."""
    check_ulysses(q.shape[1], k.shape[1], comm.mesh.size(axis))
    where = _gather_where(comm, axis, q, index, docs)
    all_index, all_docs = where.flat()
    allowed = attention_mask(all_index, all_index, all_docs, all_docs)
    qh, kh, vh = (_SeqToHeads.apply(x, comm, axis) for x in (q, k, v))
    return _HeadsToSeq.apply(_sdpa(qh, kh, vh, allowed, scale), comm, axis)


ATTENTION: dict[str, Callable] = {"ring": ring_attention, "allgather": allgather_attention,
                                  "ulysses": ulysses_attention}


def context_attention(method: str, q, k, v, comm: Comm, axis: str, index: torch.Tensor,
                      docs: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The attention of `method` (one of METHODS)."""
    if method not in ATTENTION:
        raise UserError(f"parallel.cp_method: unknown method '{method}'; choose one of {', '.join(METHODS)}")
    return ATTENTION[method](q, k, v, comm, axis, index, docs, scale)


class ContextCore:
    """The reference decoder's attention core under context parallelism (models/decoder.py
    `AttentionCore`): rotary embedding at `positions` (the global ones: `index` for one document
    per sequence, restarting per document when packed) and the attention of `method` over `axis`."""

    def __init__(self, method: str, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None):
        if method not in ATTENTION:
            raise UserError(f"parallel.cp_method: unknown method '{method}'; choose one of {', '.join(METHODS)}")
        self.method, self.comm, self.axis, self.index, self.docs = method, comm, axis, index, docs
        self.positions = index if positions is None else positions

    def rotary_positions(self, seq: int, device) -> torch.Tensor | None:
        return self.positions

    def set_documents(self, docs: torch.Tensor, positions: torch.Tensor) -> None:
        """The document ids and positions (b, s) of the local tokens of the next micro-batch (packed rows:
        they change with every micro-batch; the global indices `index` stay)."""
        self.docs, self.positions = docs, positions

    def __call__(self, q, k, v, scale: float | None = None) -> torch.Tensor:
        """`scale`: the softmax scale (None: head_dim ** -0.5); a Hugging Face attention passes its `scaling`."""
        return ATTENTION[self.method](q, k, v, self.comm, self.axis, self.index, self.docs, scale)


# ------------------------------------------------------------------ training

# The modules with an attention seam (an `attention_core`: None, or a core computing their attention):
# the reference decoder's `Attention`, the Hugging Face blocks (`HFBlock`: the dense Llama-shaped families
# and the mixtures of experts; `GPT2Block`; models/hf_attention.py). And the embeddings with a learned
# positions' seam (`positions`: None, or the positions of the local tokens).
AttentionSeam = Attention | HFBlock | GPT2Block
LearnedPositions = Embedding | GPT2Embedding


def _wire(model: torch.nn.Module, comm: Comm, axis: str, method: str,
          seq_len: int) -> tuple[ContextCore, int, list[LearnedPositions]]:
    """One `ContextCore` of `method` over `axis`, at this rank's zigzag index of a `seq_len` sequence, in
    every attention seam of `model` (`AttentionSeam`): (the core, the attentions wired, the model's
    embeddings with learned positions' seams, `LearnedPositions`)."""
    mesh = comm.mesh
    index = zigzag_index(seq_len, mesh.size(axis), mesh.rank(axis), device=mesh.device)
    core = ContextCore(method, comm, axis, index)
    wired, embeddings = 0, []
    for module in model.modules():
        if isinstance(module, AttentionSeam):
            module.attention_core = core
            wired += 1
        elif isinstance(module, LearnedPositions):
            embeddings.append(module)
    return core, wired, embeddings


def install_context(model: torch.nn.Module, comm: Comm, axis: str, method: str, seq_len: int) -> int:
    """Wire context parallelism into the model (parallel step 2b): every attention seam (`AttentionSeam`:
    the reference decoder's, the Hugging Face families') gets a `ContextCore` of `method` over `axis`,
    and the learned position embeddings (`LearnedPositions`) the global positions, both at this rank's
    zigzag index of a `seq_len` sequence (one document per sequence: the index is the same for every
    micro-batch, so one core serves the whole run). Returns the number of attentions wired (0: the
    model has no attention seam)."""
    core, wired, embeddings = _wire(model, comm, axis, method, seq_len)
    for embedding in embeddings:
        embedding.positions = core.index
    return wired


class PackedDocuments:
    """Packed rows (`data.pack`): the one `ContextCore` of every attention and the learned position
    embeddings, handed each micro-batch's document ids and positions (`set`) before its forward."""

    def __init__(self, core: ContextCore, embeddings: list[LearnedPositions]):
        self.core, self.embeddings = core, embeddings

    def set(self, documents: torch.Tensor, positions: torch.Tensor) -> None:
        """This micro-batch's ids and positions of the local tokens, (b, s) (under cp: split like the tokens)."""
        self.core.set_documents(documents, positions)
        for embedding in self.embeddings:
            embedding.positions = positions


def install_documents(model: torch.nn.Module, comm: Comm, axis: str, method: str,
                      seq_len: int) -> PackedDocuments | None:
    """Packed rows (parallel step 2b, `data.pack`): every block's attention gets one `ContextCore` of
    `method` over `axis` at this rank's zigzag index of `seq_len`, masking by document, and the learned
    position embedding is wired to the same per-token positions; `PackedDocuments.set` hands both each
    micro-batch's ids and positions. On an axis of one rank (cp = 1) the core communicates nothing
    (allgather there is SDPA under the causal + document mask). None: the model has no attention seam."""
    core, wired, embeddings = _wire(model, comm, axis, method, seq_len)
    return PackedDocuments(core, embeddings) if wired else None


def split_micro_batch(tokens: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """This rank's zigzag part of a micro-batch's (b, S) inputs or targets along the sequence."""
    return zigzag_split(tokens, comm.mesh.size(axis), comm.mesh.rank(axis), dim=1)
