"""Differentiable collectives: the conjugate pairs that tensor and sequence parallelism need.

Each function runs one collective forward and its conjugate backward (Megatron-LM's f / g
operators and their sequence-parallel versions), always through `Comm`, so every byte is
counted on the mesh axis it crosses:

    copy_to_group        forward identity            backward all-reduce      (Megatron "f")
    reduce_from_group    forward all-reduce          backward identity        (Megatron "g")
    gather_from_group    forward all-gather (dim)    backward take own chunk
    scatter_to_group     forward take own chunk      backward all-gather (dim)
    reduce_scatter_to_group  forward reduce-scatter (dim)  backward all-gather (dim)   (SP "g")
    all_gather_from_group    forward all-gather (dim)      backward reduce-scatter (dim) (SP "f")
    all_to_all_rows      forward all-to-all of rows    backward the reverse all-to-all (expert dispatch)
"""

from __future__ import annotations

import torch

from .collectives import Comm


def gather_along(comm: Comm, x: torch.Tensor, axis: str, dim: int, tag: str = "") -> torch.Tensor:
    """The ranks' `x` concatenated along `dim` (not differentiable; `tag` files the bytes)."""
    return start_gather_along(comm, x, axis, dim, tag).wait()


class PendingGather:
    """An all-gather along a dimension in flight: `wait()` gives the gathered tensor."""

    def __init__(self, out: torch.Tensor, handle, dim: int):
        self._out, self._handle, self._dim = out, handle, dim

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._out.movedim(0, self._dim)


def start_gather_along(comm: Comm, x: torch.Tensor, axis: str, dim: int, tag: str = "") -> PendingGather:
    """Issue `gather_along` without waiting for it: the caller computes something else meanwhile."""
    n = comm.mesh.size(axis)
    if n == 1:
        return PendingGather(x.movedim(dim, 0), None, dim)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    return PendingGather(out, comm.all_gather(out, moved, axis, async_op=True, tag=tag), dim)


def _gather(comm: Comm, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return gather_along(comm, x, axis, dim)


def _reduce_scatter(comm: Comm, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n = comm.mesh.size(axis)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % n:
        raise ValueError(f"dimension {dim} of size {moved.shape[0]} cannot be split over {n} ranks of '{axis}'")
    out = torch.empty((moved.shape[0] // n,) + moved.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, moved, axis)
    return out.movedim(0, dim)


def _own_chunk(comm: Comm, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n = comm.mesh.size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} cannot be split over {n} ranks of '{axis}'")
    return x.chunk(n, dim)[comm.mesh.rank(axis)].contiguous()


def _all_reduce(comm: Comm, x: torch.Tensor, axis: str) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, axis)
    return x


def _identity(comm: Comm, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return x.view_as(x)


def _sum(comm: Comm, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    return _all_reduce(comm, x, axis)


class _Conjugate(torch.autograd.Function):
    """`forward_op` forward and `backward_op` on the gradient: each op is f(comm, x, axis, dim)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, comm, axis, dim):
        ctx.backward_op, ctx.comm, ctx.axis, ctx.dim = backward_op, comm, axis, dim
        return forward_op(comm, x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(ctx.comm, grad, ctx.axis, ctx.dim), None, None, None, None, None


def copy_to_group(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return _Conjugate.apply(x, _identity, _sum, comm, axis, 0)


def reduce_from_group(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    return _Conjugate.apply(x, _sum, _identity, comm, axis, 0)


def gather_from_group(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    return _Conjugate.apply(x, _gather, _own_chunk, comm, axis, dim % x.dim())


def scatter_to_group(x: torch.Tensor, comm: Comm, axis: str, dim: int = -1) -> torch.Tensor:
    return _Conjugate.apply(x, _own_chunk, _gather, comm, axis, dim % x.dim())


def reduce_scatter_to_group(x: torch.Tensor, comm: Comm, axis: str, dim: int = 1) -> torch.Tensor:
    return _Conjugate.apply(x, _reduce_scatter, _gather, comm, axis, dim % x.dim())


def all_gather_from_group(x: torch.Tensor, comm: Comm, axis: str, dim: int = 1) -> torch.Tensor:
    return _Conjugate.apply(x, _gather, _reduce_scatter, comm, axis, dim % x.dim())


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, axis, output_splits, input_splits):
        ctx.comm, ctx.axis, ctx.splits = comm, axis, (list(output_splits), list(input_splits))
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), output_splits, input_splits, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all_v(out, grad.contiguous(), input_splits, output_splits, ctx.axis)
        return out, None, None, None, None


def all_to_all_rows(x: torch.Tensor, comm: Comm, axis: str, output_splits: list[int],
                    input_splits: list[int]) -> torch.Tensor:
    """Rows of `x` to the members of `axis` (`input_splits[j]` to member j), `output_splits[i]` rows
    received from member i; backward sends the gradients back the same way."""
    return _AllToAllRows.apply(x, comm, axis, output_splits, input_splits)
