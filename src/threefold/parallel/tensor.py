"""Tensor (Megatron-style) parallel layers and the sequence-parallel glue between them.

Every layer holds only this rank's slice of its weight and runs the collectives of
comm/autograd.py around its matmul, so every byte is counted on the "tp" axis:

    entering a region      copy_to_group       fwd identity        bwd all-reduce    (Megatron "f")
                           all_gather_from_group   fwd all-gather(s)  bwd reduce-scatter(s)  (SP)
    ColumnParallelLinear   no collective: y_r = x W_r^T + b_r, this rank's output features
    RowParallelLinear      reduce_from_group   fwd all-reduce      bwd identity      (Megatron "g")
                           reduce_scatter_to_group fwd reduce-scatter(s) bwd all-gather(s) (SP)
    VocabParallelEmbedding masked lookup of this rank's vocabulary rows, then the row-parallel reduce
    vocab_parallel_cross_entropy  3 all-reduces of b*s numbers (max, target logit, sum of exp)

A region (attention, MLP, output head) is entered once, so q, k and v (or gate and up) share
one input collective: a block costs two all-reduces forward and two backward, of b*s*h each.
Under sequence parallelism the activations between regions are split along the sequence and
those all-reduces become all-gather / reduce-scatter pairs of the same total volume; the
parameters used there (norm gains, row-parallel biases) then see only part of the tokens, so
their gradients are summed over tp by a gradient hook (bytes filed under
"all_reduce.partial_grads").
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import (Comm, all_gather_from_group, copy_to_group, gather_from_group, reduce_from_group,
                    reduce_scatter_to_group, scatter_to_group)
from ..models.cross_entropy import softmax_minus_one_hot
from ..models.loss_pieces import chunk_rows
from ..sharding import Placement
from .sequence_region import AXIS, SequenceRegion, _LinearOnShard, _Regather  # noqa: F401 (AXIS: re-exported)


def padded_size(size: int, parts: int) -> int:
    """`size` rounded up to a multiple of `parts` (vocabularies not divisible by tp)."""
    return -(-size // parts) * parts


def as_parameter(t: torch.Tensor | None) -> nn.Parameter | None:
    """`t` as a Parameter, the same object when it already is one (tied weights stay tied)."""
    if t is None or isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t, requires_grad=t.requires_grad)


def sum_gradient_over(param: nn.Parameter, comm: Comm, axis: str = AXIS) -> None:
    """Sum `param`'s gradient over `axis` in every backward pass.

    For a replicated parameter that each rank applies to only part of the data (norm gains on
    its sequence chunk, replicated key/value heads serving only its query heads): the true
    gradient is the sum of the ranks' partial ones. The hook sees each backward pass's total
    gradient of the leaf once, before it is accumulated into `.grad`.
    """
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, axis, tag="partial_grads")
        return grad

    param.register_hook(hook)


def enter_region(x: torch.Tensor, comm: Comm, sequence_parallel: bool, seq_dim: int = 1) -> torch.Tensor:
    """Input of a tensor-parallel region: f (identity / all-reduce) or, under SP, all-gather of the sequence."""
    if sequence_parallel:
        return all_gather_from_group(x, comm, AXIS, seq_dim)
    return copy_to_group(x, comm, AXIS)


def leave_region(y: torch.Tensor, comm: Comm, sequence_parallel: bool, seq_dim: int = 1) -> torch.Tensor:
    """Output of a region from partial sums: g (all-reduce) or, under SP, reduce-scatter along the sequence."""
    if sequence_parallel:
        return reduce_scatter_to_group(y, comm, AXIS, seq_dim)
    return reduce_from_group(y, comm, AXIS)


class LinearKernel(Protocol):
    """The matmul of a tensor-parallel linear, y = x W^T + b (W as F.linear takes it); `shard`: under
    sequence parallelism, (the region's sequence shard of x, its _Regather) to save instead of x."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 shard: "tuple[torch.Tensor, _Regather] | None" = None) -> torch.Tensor: ...


class ColumnParallelLinear(nn.Module):
    """y_bs[o/tp] = x_bsh W_r^T + b_r: this rank's slice of the output features.

    No collective on the input: the enclosing region entered the tp group once for all its
    column-parallel layers. `rows` (start, count) uses only some rows of a replicated weight
    (key/value heads of grouped-query attention when there are fewer of them than tp ranks).
    `gather_output` all-gathers the features (fwd all-gather, bwd own chunk) and drops the
    padding beyond `out_features`: for users that need the whole output, e.g. a library loss.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                 rows: tuple[int, int] | None = None, gather_output: bool = False, out_features: int | None = None,
                 transposed: bool = False):
        super().__init__()
        self.comm = comm
        self.weight = as_parameter(weight)
        self.bias = as_parameter(bias)
        self.rows = rows
        self.gather_output = gather_output
        self.transposed = transposed  # weight stored (in, out): GPT-2's Conv1D
        self.in_features = weight.shape[0 if transposed else 1]
        self.out_features = out_features or (rows[1] if rows else weight.shape[1 if transposed else 0])
        self.region: SequenceRegion | None = None  # the enclosing region under sequence parallelism
        self.kernel: LinearKernel | None = None  # another matmul (fp8: parallel/fp8.py); None: F.linear

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        weight, bias = (self.weight.t() if self.transposed else self.weight), self.bias
        if self.rows is not None:
            weight = weight.narrow(0, *self.rows)
            bias = None if bias is None else bias.narrow(0, *self.rows)
        shard = self.region.shard_of(x_bsh) if self.region is not None else None
        if self.kernel is not None:
            y = self.kernel(x_bsh, weight, bias, shard if torch.is_grad_enabled() else None)
        elif shard is not None and torch.is_grad_enabled():
            y = _LinearOnShard.apply(x_bsh, shard[0], weight, bias, shard[1])
        else:
            y = F.linear(x_bsh, weight, bias)
        if self.gather_output:
            y = gather_from_group(y, self.comm, AXIS, -1)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, rows={self.rows}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y_bsh = sum_r x_r W_r^T + b: partial products summed over tp, then the (replicated) bias.

    Forward all-reduce (Megatron "g"), or reduce-scatter along the sequence under SP, where the
    bias then meets only this rank's tokens: the plan sums its gradient over tp.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, sequence_parallel: bool,
                 seq_dim: int = 1, transposed: bool = False):
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.weight = as_parameter(weight)
        self.bias = as_parameter(bias)
        self.transposed = transposed  # weight stored (in, out): GPT-2's Conv1D
        self.in_features = weight.shape[0 if transposed else 1] * comm.mesh.size(AXIS)
        self.out_features = weight.shape[1 if transposed else 0]
        self.kernel: LinearKernel | None = None  # another matmul (fp8: parallel/fp8.py); None: F.linear
        self.region: SequenceRegion | None = None  # the enclosing region under sequence parallelism

    def forward(self, x_bsf: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        local = F.linear(x_bsf, weight) if self.kernel is None else self.kernel(x_bsf, weight, None)
        if self.region is not None and torch.is_grad_enabled():  # the regather starts with the backward
            local = self.region.prefetch(local)
        y = leave_region(local, self.comm, self.sequence_parallel, self.seq_dim)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the (padded) embedding table; other ids look up zeros.

    The ranks' partial lookups are summed: all-reduce, or reduce-scatter along the sequence
    under SP (which is where the sequence-parallel region of the model begins).
    """

    def __init__(self, weight: torch.Tensor, start: int, vocab: int, comm: Comm, sequence_parallel: bool,
                 padding_idx: int | None = None, seq_dim: int = 1):
        super().__init__()
        self.comm = comm
        self.weight = as_parameter(weight)
        self.start = start
        self.num_embeddings = vocab
        self.embedding_dim = weight.shape[1]
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        local_pad = None if padding_idx is None else padding_idx - start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.shape[0] else None

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        local = tokens_bs - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(x, self.comm, self.sequence_parallel, self.seq_dim)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.weight.shape[0]} of {self.num_embeddings}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(logits)[target] per token, from this rank's vocabulary slice only.

    Forward: three all-reduces of one number per token (max, target logit, sum of exp), so the
    softmax over the whole vocabulary is exact while each rank holds only (tokens, vocab/tp).
    The logits stay in their dtype: the sums run in fp32 one chunk of rows at a time and only the
    fp32 log-sum-exp per token is kept (models/cross_entropy.py). Backward: softmax - one_hot(target)
    on the local slice, chunk by chunk, no communication. Columns from `valid` on (padding) never count.
    """

    @staticmethod
    def forward(ctx, logits_nv, targets_n, comm, start, valid):
        n = logits_nv.shape[0]
        real = logits_nv[:, :valid]
        maxes = (real.amax(dim=-1).float() if valid > 0 else
                 torch.full((n,), -math.inf, dtype=torch.float32, device=logits_nv.device))
        comm.all_reduce(maxes, AXIS, op=dist.ReduceOp.MAX)
        local = targets_n - start
        outside = (local < 0) | (local >= valid)
        local = local.masked_fill(outside, 0)
        picked = logits_nv.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(outside, 0.0)
        comm.all_reduce(picked, AXIS)
        sum_exp = torch.zeros(n, dtype=torch.float32, device=logits_nv.device)
        step = chunk_rows(n, valid, logits_nv.element_size())
        for i in range(0, n if valid > 0 else 0, step):
            part = real[i:i + step].to(torch.float32, copy=True)
            sum_exp[i:i + step] = part.sub_(maxes[i:i + step].unsqueeze(-1)).exp_().sum(dim=-1)
        comm.all_reduce(sum_exp, AXIS)
        lse = sum_exp.log_().add_(maxes)
        ctx.save_for_backward(logits_nv, local, outside, lse)
        ctx.valid = valid
        return lse - picked

    @staticmethod
    def backward(ctx, grad_n):
        logits, local, outside, lse = ctx.saved_tensors
        grad = softmax_minus_one_hot(logits, local, lse, ctx.valid, grad_n.float(), hit_n=(~outside).float())
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits_nv: torch.Tensor, targets_n: torch.Tensor, comm: Comm, start: int,
                                 vocab: int) -> torch.Tensor:
    """Per-token loss (n,) from local logits (n, vocab_slice) whose first column is global id `start`."""
    valid = max(0, min(logits_nv.shape[-1], vocab - start))
    return _VocabParallelCrossEntropy.apply(logits_nv, targets_n, comm, start, valid)


class VocabParallelCrossEntropy(nn.Module):
    """Sum of token losses from vocabulary-sharded logits (b, s, vocab/tp); never gathers them."""

    def __init__(self, comm: Comm, start: int, vocab: int):
        super().__init__()
        self.comm, self.start, self.vocab = comm, start, vocab

    def forward(self, logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_bsv.flatten(0, 1), targets_bs.flatten(), self.comm, self.start,
                                            self.vocab).sum()


def scatter_sequence(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's chunk of a replicated tensor along the sequence (fwd own chunk, bwd all-gather)."""
    return scatter_to_group(x, comm, AXIS, dim)


def gather_vocab(logits_bsv: torch.Tensor, comm: Comm, vocab: int) -> torch.Tensor:
    """Whole-vocabulary logits from the shards (all-gather; padding dropped): for inspection and sampling."""
    return gather_from_group(logits_bsv, comm, AXIS, -1)[..., :vocab]


@torch.no_grad()
def gather_full(tensors: dict[str, torch.Tensor], placements: dict[str, Placement], comm: Comm,
                axis: str = AXIS) -> dict[str, torch.Tensor]:
    """Whole global tensors, by global name, from tensors split over `axis` (padding dropped).

    Reads the placements only: a tensor replicated over `axis` is already whole; a split one is
    all-gathered (every rank of the axis holds the same box shape) and each rank's box is put
    at its offsets. Every rank of `axis` must call this with the same names in the same order.
    Used by checkpoint export and by parity tests to compare gradients and parameters.
    """
    out = {}
    for local_name, t in tensors.items():
        place = placements[local_name]
        if place.flat_range is not None:
            raise ValueError(f"{local_name}: flat shards (ZeRO) are not gathered here")
        if axis in place.replicated_over or comm.mesh.size(axis) == 1:
            out[place.name] = t.detach()[tuple(slice(0, g) for g in place.global_shape)].clone()
            continue
        n = comm.mesh.size(axis)
        pieces = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        comm.all_gather(pieces, t.contiguous(), axis)
        offsets = torch.tensor(place.offsets, dtype=torch.int64, device=t.device)
        all_offsets = torch.empty(n * offsets.numel(), dtype=torch.int64, device=t.device)
        comm.all_gather(all_offsets, offsets, axis)
        full = torch.zeros(place.global_shape, dtype=t.dtype, device=t.device)
        for piece, offs in zip(pieces.chunk(n), all_offsets.view(n, -1).tolist()):
            theirs = replace(place, offsets=tuple(offs))  # every rank of the axis holds the same box shape
            for seg in theirs.segments():
                full[tuple(slice(o, o + k) for o, k in zip(seg.offsets, seg.shape))] = seg.view(piece, theirs)
        out[place.name] = full
    return out
