"""Sequence parallelism's saved shards: a tensor-parallel region's column-parallel linears keep the 1/tp
sequence shard of their input, not the gathered tensor, and their backward gathers it again - issued
when the region's backward starts and waited for only by the weight gradients (`SequenceRegion`,
parallel/tensor.py's linears use it; docs/tensor.md)."""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..comm import Comm, all_gather_from_group
from ..comm.autograd import PendingGather, start_gather_along

AXIS = "tp"  # the tensor-parallel axis the regions gather over (parallel/tensor.py re-exports it)


class _Regather:
    """One forward of a sequence-parallel region: its consumers' backward all-gather the saved shard
    once between them (the first gathers, the last lets the gathered tensor go). Only consumers of
    the region's own forward count; a checkpoint's recomputation of them does not.

    The all-gather is issued (`start`) before the work that hides it and waited for (`gather`) only
    where the gathered input is needed, by the weight-gradient matmul: at the start of the region's
    backward (SequenceRegion.prefetch), or else by the first consumer's backward before its
    input-gradient matmul, which needs only the weight (Megatron-LM's overlap)."""

    eager: ClassVar[bool] = False  # `prefetch` kept out of torch.compile's graphs (keep_regather_eager)

    def __init__(self, comm: Comm, seq_dim: int, shard: torch.Tensor):
        self.comm, self.seq_dim = comm, seq_dim
        self.uses, self.done, self.full, self.open = 0, 0, None, True
        self.pending: PendingGather | None = None
        self.shard_ref = weakref.ref(shard)  # the region's shard, alive while a consumer keeps it

    def prefetch(self) -> None:
        """`start` with the shard the consumers kept; nothing when none did (a checkpointed or offloaded
        region: its shard comes back with the recomputation, and the first consumer starts it)."""
        shard = self.shard_ref()
        if shard is not None:
            self.start(shard)

    def start(self, shard: torch.Tensor) -> None:
        """Issue the all-gather of `shard` unless this backward already did."""
        if self.full is None and self.pending is None:
            self.pending = start_gather_along(self.comm, shard, AXIS, self.seq_dim, tag="sp_regather")

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.start(shard)
            self.full, self.pending = self.pending.wait(), None
        full = self.full
        self.done += 1
        if self.done >= self.uses:
            self.full, self.done = None, 0  # a second backward (recomputation) gathers again
        return full


def keep_regather_eager() -> None:
    """Mark `_Regather.prefetch` (a weak reference and a collective) as never traced by torch.compile,
    as comm/tracing.py does Comm's collectives: one graph break where a region's backward starts. Called
    by `train.compile` only (importing dynamo costs seconds and memory runs without compile do not pay)."""
    if not _Regather.eager:
        _Regather.prefetch = torch.compiler.disable(_Regather.prefetch,
                                                    reason="_Regather.prefetch: a weak reference and a collective")
        _Regather.eager = True


class _Entry:
    """One forward of a region: the gathered tensor (weakly) and, as long as that lives, its shard (a
    checkpoint inside the region keeps the gathered tensor as its input, and its recomputation finds
    the shard by it); afterwards only what the consumers saved keeps the shard alive."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, regather: _Regather):
        self.full = weakref.ref(full, self._full_gone)
        self.shard: torch.Tensor | None = shard
        self.regather = regather

    def _full_gone(self, _ref) -> None:
        self.shard = None


class _Prefetch(torch.autograd.Function):
    """Identity on the region's output before its exit collective; its backward, the first of the
    region's, issues the regather of the shard while the rest of the region's backward runs."""

    @staticmethod
    def forward(ctx, y, regather):
        ctx.regather = regather
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.regather.prefetch()
        return grad, None


class SequenceRegion:
    """A tensor-parallel region's input under sequence parallelism, kept as its 1/tp sequence shard.

    The region all-gathers its (b, s/t, h) input once for all its column-parallel linears; each of
    them saves the shard, not the (b, s, h) gathered tensor, and their backward gathers it again
    (one all-gather per region per backward, bytes filed under "all_gather.sp_regather"), as
    Megatron-LM does (Korthikanti et al. 2022, section 4.2.2). The gathered tensor lives only
    through the region's forward (unless a checkpoint inside the region keeps it as its input).
    A linear finds its shard by the gathered tensor it was given (a weak reference; the region holds
    the shard only while that tensor lives, so after the region's forward nothing of it stays alive
    but what the consumers saved), and a checkpoint's recomputation inside the region, which keeps
    the gathered tensor as its input, saves exactly what the first forward saved.

    The regather overlaps the region's backward: its row-parallel linear marks its output
    (`prefetch`), whose gradient is the first of the region's backward, and the all-gather is issued
    there, under the row-parallel linear's and the attention's (or activation's) backward; the
    consumers wait for it before their weight-gradient matmul. Where the shard was not kept (a
    checkpointed or offloaded region recomputes or reloads it), the first consumer issues it under
    its own input-gradient matmul.
    """

    def __init__(self, comm: Comm, seq_dim: int):
        self.comm, self.seq_dim = comm, seq_dim
        self._entries: list[_Entry] = []

    def enter(self, x_shard: torch.Tensor) -> torch.Tensor:
        full = all_gather_from_group(x_shard, self.comm, AXIS, self.seq_dim)
        self._entries = [e for e in self._entries if e.full() is not None]
        self._entries.append(_Entry(full, x_shard, _Regather(self.comm, self.seq_dim, x_shard)))
        return full

    def shard_of(self, x_full: torch.Tensor) -> tuple[torch.Tensor, _Regather] | None:
        """(shard, regather) when `x_full` is a tensor this region's entry gathered."""
        for entry in self._entries:
            if entry.full() is x_full and entry.shard is not None:
                return entry.shard, entry.regather
        return None

    def prefetch(self, y: torch.Tensor) -> torch.Tensor:
        """`y` (the region's output before its exit collective), marked to issue the regather of the
        running forward's shard when its gradient arrives."""
        entry = self._entries[-1] if self._entries else None
        if entry is None or entry.shard is None or not y.requires_grad:
            return y
        return _Prefetch.apply(y, entry.regather)

    def leave(self) -> None:
        if self._entries:
            self._entries[-1].regather.open = False


class _LinearOnShard(torch.autograd.Function):
    """y = x_full W^T + b, saving the region's shard instead of x_full; backward regathers it."""

    @staticmethod
    def forward(ctx, x_full, x_shard, weight, bias, regather):
        regather.uses += regather.open
        ctx.regather, ctx.has_bias = regather, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        ctx.regather.start(x_shard)  # in flight during the input-gradient matmul
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        x_full = ctx.regather.gather(x_shard)
        flat = grad_y.reshape(-1, grad_y.shape[-1])
        grad_w = flat.t().matmul(x_full.reshape(-1, x_full.shape[-1])) if ctx.needs_input_grad[2] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_x, None, grad_w, grad_b, None
