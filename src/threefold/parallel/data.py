"""Data parallelism: gradients summed over the dp axis in buckets, overlapped with backward.

Written on `comm/` rather than by wrapping DistributedDataParallel, so every byte is counted
and the same buckets serve compression hooks and ZeRO. The reducer *sums*: the training step
divides each micro-batch's summed token loss by the global token count before backward, so
the sum over ranks is already the gradient of the global mean loss (exact even when ranks
hold different numbers of tokens).

Gradient accumulation: during every micro-batch but the last, buckets only accumulate
locally; the last micro-batch's backward launches each bucket's all-reduce the moment the
bucket is full, while autograd goes on computing earlier layers' gradients.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from ..comm import Comm
from .buckets import Bucket, GradientBuckets


class CommHook(Protocol):
    """How one bucket's gradients cross the dp axis (plain all-reduce, a cast, a compressor)."""

    def launch(self, bucket: Bucket, comm: Comm, axis: str):
        """Start communicating `bucket.buffer`; return an object with wait()."""

    def complete(self, bucket: Bucket) -> None:
        """After wait(): leave the summed gradient in `bucket.buffer`."""


class AllReduceHook:
    """The baseline: all-reduce the bucket, optionally on the wire in another dtype."""

    def __init__(self, wire_dtype: torch.dtype | None = None):
        self.wire_dtype = wire_dtype

    def launch(self, bucket: Bucket, comm: Comm, axis: str):
        tensor = bucket.buffer
        if self.wire_dtype is not None and self.wire_dtype != tensor.dtype:
            tensor = bucket.state["wire"] = tensor.to(self.wire_dtype)
        return comm.all_reduce(tensor, axis, async_op=True)

    def complete(self, bucket: Bucket) -> None:
        wire = bucket.state.pop("wire", None)
        if wire is not None:
            bucket.buffer.copy_(wire)


class DataParallelReducer:
    """Sums the gradients of `params` over `axis` of the mesh."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, bucket_mb: float = 25.0,
                 hook: CommHook | None = None, axis: str = "dp"):
        self.comm = comm
        self.axis = axis
        self.hook = hook or AllReduceHook()
        self.buckets = GradientBuckets(
            params, int(bucket_mb * 2**20),
            launch=lambda b: self.hook.launch(b, comm, axis),
            complete=self.hook.complete)

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Run one micro-batch's backward inside; only the last one communicates."""
        self.buckets.sync = last
        try:
            yield
        finally:
            if not last:
                self.buckets.reset_pass()

    def finish(self) -> None:
        """After the last backward: launch what is left, wait for every bucket."""
        self.buckets.flush()

    def zero_grad(self) -> None:
        self.buckets.zero_grad()

    def gradient_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets.buckets)


def parallelize_data(model: nn.Module, comm: Comm, bucket_mb: float = 25.0,
                     hook: CommHook | None = None) -> DataParallelReducer:
    """Attach a bucketed gradient reducer over dp to `model`'s trainable parameters."""
    return DataParallelReducer(list(model.parameters()), comm, bucket_mb, hook)
