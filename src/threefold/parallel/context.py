"""Context parallelism: the sequence of every micro-batch split over the ranks of one mesh axis.

Every function takes the axis by name (`axis`), so it runs on any axis of the Mesh; all bytes go
through `Comm` and are counted there (docs/context.md has the figures per method).

Zigzag split (causal load balance). The sequence of S tokens is cut into 2 cp chunks; rank i
holds chunks i and 2cp-1-i, in that order, so every rank holds one early and one late chunk and
does the same causal attention work. `zigzag_index` gives the global sequence index of each local
token: the causal mask and (for one document per sequence) the rotary positions.

Masks. Token q attends to token k when k's global index is not after q's and, with packed
documents, both carry the same document id (`docs`, any lengths, crossing chunk and rank
boundaries). Without documents every method takes its blocks from the zigzag layout (host integers:
sizes and ranks), on the fused kernels that return the log-sum-exp (models/attention.py), with no
mask and nothing read back to the host. With documents, every method gathers the ranks' indices
and ids once (`all_gather.mask`, small int64 tensors; gathered without documents too, the figures in
docs/context.md) and masks by them: on CUDA allgather and ulysses through FlexAttention under a
block mask built on the device (`document_kernel`, chosen once when the core is built), the ring
through the fused blocks under an additive bias; on CPU SDPA under the boolean mask (the fallback).

Methods (each a differentiable function of local q (b, heads, s, d), k and v (b, kv_heads, s, d)
returning the local output (b, heads, s, d); GQA: kv_heads divides heads):

    ring       K and V rotate around the axis by p2p (`Comm.batch_send_recv`), the next block's
               transfer posted before the current block's attention so the two overlap. Each
               (query chunk, key chunk) pair of the zigzag halves is wholly visible, causal (the
               same chunk) or invisible, decided from the ranks alone (`_ring_blocks`): the visible
               ones run through the fused forward (flash / efficient on CUDA, flash on CPU) and merge
               by log-sum-exp. Backward runs the fused backward of each block against the merged
               output and log-sum-exp; K and V rotate again and the fp32 dK/dV of each block travel
               with it, one hop behind, and go home at the end.
    allgather  K and V all-gathered (one call) and put in sequence order; the local chunks attend
               the earlier chunks wholly and their own causally (fused blocks, lse-merged);
               backward reduce-scatters their gradients.
    ulysses    all-to-all from sequence-sharded to head-sharded q, k, v; the whole sequence put in
               order and SDPA is_causal on heads/cp heads; all-to-all back. Heads and kv heads must
               divide by cp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..comm.autograd import all_gather_from_group, gather_along
from ..comm.collectives import Comm
from ..errors import UserError
from ..models.attention import (Block, additive, block_attention, block_backward, block_forward, document_attention,
                                document_kernel, merge)
from ..models.spec import ContextSeams

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


def _ring_blocks(rank: int, src: int, cp: int, s: int, where: _Where | None) -> list[Block]:
    """The visible blocks of this rank's queries on rank `src`'s keys, from the ranks alone: local
    halves are the zigzag chunks (rank, 2cp-1-rank), so each (query chunk, key chunk) pair is wholly
    visible (an earlier chunk), causal (the same chunk) or invisible (a later one). With documents
    each visible block carries its slice of the causal + document mask (the mask fallback)."""
    c = s // 2
    mask = None if where is None or where.docs is None else where.local_mask(rank, src)
    blocks = []
    for qi, gq in enumerate((rank, 2 * cp - 1 - rank)):
        for ki, gk in enumerate((src, 2 * cp - 1 - src)):
            if gk > gq:
                continue
            rows, cols = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
            if mask is None:
                blocks.append(Block(rows, cols, causal=gk == gq))
            else:
                blocks.append(Block(rows, cols, bias=additive(mask[:, None, rows, cols], torch.float32)))
    return blocks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, axis, where, scale, stats):
        cp, rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        nxt_rank, prev_rank = (rank + 1) % cp, (rank - 1) % cp
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()
        plan = []  # per step, the blocks computed and their forwards' aux (backward takes the same ones)
        for t in range(cp):
            src = (rank - t) % cp
            pending = []
            if t < cp - 1:  # the next block travels while this one is computed
                incoming = torch.empty_like(kv)
                pending = comm.batch_send_recv([(kv, axis, nxt_rank)], [(incoming, axis, prev_rank)])
            plan.append([])
            for blk in _ring_blocks(rank, src, cp, q.shape[2], where):
                bias = None if blk.bias is None else blk.bias.to(q.dtype)
                o_b, l_b, aux = block_forward(q[..., blk.rows, :], kv[0][..., blk.cols, :], kv[1][..., blk.cols, :],
                                              blk.causal, scale, bias)
                out[..., blk.rows, :], lse[..., blk.rows] = merge(out[..., blk.rows, :], lse[..., blk.rows], o_b, l_b)
                plan[-1].append((blk, aux))
                stats.append((t, blk.rows.start, blk.cols.start))
            for handle in pending:
                handle.wait()
            if pending:
                kv = incoming
        result = out.to(q.dtype)
        ctx.comm, ctx.axis, ctx.plan, ctx.scale = comm, axis, plan, scale
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, axis, plan, scale = ctx.comm, ctx.axis, ctx.plan, ctx.scale
        cp, rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        nxt_rank, prev_rank = (rank + 1) % cp, (rank - 1) % cp
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack((k, v)).contiguous()
        own = None  # dK, dV of this rank's own block from its own queries
        arriving, acc_pending, sending = None, [], None
        for t in range(cp):
            pending = []
            if t < cp - 1:
                incoming = torch.empty_like(kv)
                pending = comm.batch_send_recv([(kv, axis, nxt_rank)], [(incoming, axis, prev_rank)])
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for blk, aux in plan[t]:
                r, c = blk.rows, blk.cols
                dq_b, dk_b, dv_b = block_backward(grad[..., r, :], q[..., r, :], kv[0][..., c, :], kv[1][..., c, :],
                                                  out[..., r, :], lse[..., r].contiguous(), blk.causal, scale, aux)
                dq[..., r, :] += dq_b
                dkv[0][..., c, :] += dk_b
                dkv[1][..., c, :] += dv_b
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
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


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


class _AllToAll(torch.autograd.Function):
    """`there(x, comm, axis)` forward, `back` (its inverse exchange) on the gradient: ulysses' two all-to-alls."""

    @staticmethod
    def forward(ctx, x, comm, axis, there, back):
        ctx.comm, ctx.axis, ctx.back = comm, axis, back
        return there(x, comm, axis)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.comm, ctx.axis), None, None, None, None


def _to_heads(x, comm, axis):
    return _AllToAll.apply(x, comm, axis, _seq_to_heads, _heads_to_seq)


def _to_seq(y, comm, axis):
    return _AllToAll.apply(y, comm, axis, _heads_to_seq, _seq_to_heads)


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
                   scale: float | None = None, kernel=None, stats: list | None = None) -> torch.Tensor:
    """Causal (+ document) attention of the local queries on every rank's keys, by ring rotation.

    `index`: the global sequence index of each local token, (s,) or (b, s); `docs`: their
    document ids (b, s) or None (one document). `stats`, when given, receives (step, query
    half, key half) for every sub-block computed in the forward (the load balance)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    where = _gather_where(comm, axis, q, index, docs)
    return _RingAttention.apply(q, k, v, comm, axis, where, scale, [] if stats is None else stats)


def _rank_to_sequence(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Every rank's zigzag part, concatenated in rank order along `dim`, put in sequence order."""
    return zigzag_unsplit(x.chunk(cp, dim), dim)


def _sequence_to_rank(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The inverse of `_rank_to_sequence`: rank r's chunks r and 2cp-1-r, for r = 0 .. cp-1, in order."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for r in range(cp) for i in (r, 2 * cp - 1 - r)], dim)


def _gathered_blocks(rank: int, cp: int, s: int) -> list[Block]:
    """This rank's two zigzag chunks of queries on the whole sequence of keys (sequence order): the
    earlier chunks wholly visible, its own chunk causal."""
    c = s // 2
    blocks = []
    for qi, g in enumerate((rank, 2 * cp - 1 - rank)):
        rows = slice(qi * c, (qi + 1) * c)
        if g:
            blocks.append(Block(rows, slice(0, g * c)))
        blocks.append(Block(rows, slice(g * c, (g + 1) * c), causal=True))
    return blocks


def allgather_attention(q, k, v, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                        scale: float | None = None, kernel=None) -> torch.Tensor:
    """Attention on all-gathered keys and values (their gradients reduce-scattered in backward): on the
    fused kernels by blocks (`_gathered_blocks`); with documents, `kernel` (FlexAttention) under a block
    mask, or without one SDPA under the boolean mask (the CPU fallback)."""
    where = _gather_where(comm, axis, q, index, docs)
    kv = all_gather_from_group(torch.stack((k, v)), comm, axis, dim=3)  # (2, b, hk, cp*s, d), rank order
    cp, rank = comm.mesh.size(axis), comm.mesh.rank(axis)
    if docs is None:
        kv = _rank_to_sequence(kv, cp, 3)
        return block_attention(q, kv[0], kv[1], _gathered_blocks(rank, cp, q.shape[2]), scale)
    k_index, k_docs = where.flat()
    if kernel is not None:
        return document_attention(q, kv[0], kv[1], where.index[rank], k_index, where.docs[rank], k_docs, scale, kernel)
    allowed = attention_mask(where.index[rank], k_index, where.docs[rank], k_docs)
    return _sdpa(q, kv[0], kv[1], allowed, scale)


def ulysses_attention(q, k, v, comm: Comm, axis: str, index: torch.Tensor, docs: torch.Tensor | None = None,
                      scale: float | None = None, kernel=None) -> torch.Tensor:
    """All-to-all to whole sequences of heads/cp heads, attention (SDPA is_causal on the sequence in
    order; with documents, under the boolean mask), all-to-all back."""
    cp = comm.mesh.size(axis)
    check_ulysses(q.shape[1], k.shape[1], cp)
    where = _gather_where(comm, axis, q, index, docs)
    qh, kh, vh = (_to_heads(x, comm, axis) for x in (q, k, v))
    if docs is None:
        qs, ks, vs = (_rank_to_sequence(x, cp, 2) for x in (qh, kh, vh))
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])
        return _to_seq(_sequence_to_rank(y, cp, 2), comm, axis)
    all_index, all_docs = where.flat()
    if kernel is not None:
        y = document_attention(qh, kh, vh, all_index, all_index, all_docs, all_docs, scale, kernel)
        return _to_seq(y, comm, axis)
    allowed = attention_mask(all_index, all_index, all_docs, all_docs)
    return _to_seq(_sdpa(qh, kh, vh, allowed, scale), comm, axis)


ATTENTION: dict[str, Callable] = {"ring": ring_attention, "allgather": allgather_attention,
                                  "ulysses": ulysses_attention}


def context_attention(method: str, q, k, v, comm: Comm, axis: str, index: torch.Tensor,
                      docs: torch.Tensor | None = None, scale: float | None = None, kernel=None) -> torch.Tensor:
    """The attention of `method` (one of METHODS); `kernel`: the documents' kernel (`document_kernel`)."""
    if method not in ATTENTION:
        raise UserError(f"parallel.cp_method: unknown method '{method}'; choose one of {', '.join(METHODS)}")
    return ATTENTION[method](q, k, v, comm, axis, index, docs, scale, kernel)


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
        self.kernel = document_kernel(comm.mesh.device)  # packed documents' kernel, chosen once (None: the mask)

    def rotary_positions(self, seq: int, device) -> torch.Tensor | None:
        return self.positions

    def set_documents(self, docs: torch.Tensor, positions: torch.Tensor) -> None:
        """The document ids and positions (b, s) of the local tokens of the next micro-batch (packed rows:
        they change with every micro-batch; the global indices `index` stay)."""
        self.docs, self.positions = docs, positions

    def __call__(self, q, k, v, scale: float | None = None) -> torch.Tensor:
        """`scale`: the softmax scale (None: head_dim ** -0.5); a Hugging Face attention passes its `scaling`."""
        return ATTENTION[self.method](q, k, v, self.comm, self.axis, self.index, self.docs, scale, self.kernel)


# ------------------------------------------------------------------ training

def _wire(model: torch.nn.Module, seams: ContextSeams, comm: Comm, axis: str, method: str,
          seq_len: int) -> tuple[ContextCore, int, list[torch.nn.Module]]:
    """One `ContextCore` of `method` over `axis`, at this rank's zigzag index of a `seq_len` sequence, in
    every attention seam of `model` (the family's `seams.attention`, models/spec.py): (the core, the
    attentions wired, the model's embeddings with learned positions, `seams.positions`)."""
    mesh = comm.mesh
    index = zigzag_index(seq_len, mesh.size(axis), mesh.rank(axis), device=mesh.device)
    core = ContextCore(method, comm, axis, index)
    wired, embeddings = 0, []
    for module in model.modules():
        if isinstance(module, seams.attention):
            module.attention_core = core
            wired += 1
        elif isinstance(module, seams.positions):
            embeddings.append(module)
    return core, wired, embeddings


def install_context(model: torch.nn.Module, seams: ContextSeams, comm: Comm, axis: str, method: str,
                    seq_len: int) -> int:
    """Wire context parallelism into the model (parallel step 2b): every attention seam the family names
    (`seams.attention`) gets a `ContextCore` of `method` over `axis`, and the learned position embeddings
    (`seams.positions`) the global positions, both at this rank's
    zigzag index of a `seq_len` sequence (one document per sequence: the index is the same for every
    micro-batch, so one core serves the whole run). Returns the number of attentions wired (0: the
    model has no attention seam)."""
    core, wired, embeddings = _wire(model, seams, comm, axis, method, seq_len)
    for embedding in embeddings:
        embedding.positions = core.index
    return wired


class PackedDocuments:
    """Packed rows (`data.pack`): the one `ContextCore` of every attention and the learned position
    embeddings, handed each micro-batch's document ids and positions (`set`) before its forward."""

    def __init__(self, core: ContextCore, embeddings: list[torch.nn.Module]):
        self.core, self.embeddings = core, embeddings

    def set(self, documents: torch.Tensor, positions: torch.Tensor) -> None:
        """This micro-batch's ids and positions of the local tokens, (b, s) (under cp: split like the tokens)."""
        self.core.set_documents(documents, positions)
        for embedding in self.embeddings:
            embedding.positions = positions


def install_documents(model: torch.nn.Module, seams: ContextSeams, comm: Comm, axis: str, method: str,
                      seq_len: int) -> PackedDocuments | None:
    """Packed rows (parallel step 2b, `data.pack`): every block's attention gets one `ContextCore` of
    `method` over `axis` at this rank's zigzag index of `seq_len`, masking by document, and the learned
    position embedding is wired to the same per-token positions; `PackedDocuments.set` hands both each
    micro-batch's ids and positions. On an axis of one rank (cp = 1) the core communicates nothing
    (allgather there is SDPA under the causal + document mask). None: the model has no attention seam."""
    core, wired, embeddings = _wire(model, seams, comm, axis, method, seq_len)
    return PackedDocuments(core, embeddings) if wired else None


def split_micro_batch(tokens: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """This rank's zigzag part of a micro-batch's (b, S) inputs or targets along the sequence."""
    return zigzag_split(tokens, comm.mesh.size(axis), comm.mesh.rank(axis), dim=1)
