"""Gradient buckets: flat buffers that gradients accumulate into, launched as they fill.

Shared machinery of the data-parallel reducer and ZeRO stage 2: each parameter's `.grad` is a
view into its bucket's flat buffer, so autograd accumulates in place and a full bucket is one
contiguous tensor ready for one collective, with no copy.

Parameters are bucketed in reverse registration order, which is roughly the order backward
produces their gradients. A bucket becomes *ready* when every one of its parameters has
accumulated its gradient in this backward pass (a post-accumulate-grad hook counts them).
Ready buckets are launched strictly in index order - bucket k only after buckets 0..k-1 - so
every rank issues the same collectives in the same order even when some parameter is unused on
some rank. `flush()` launches whatever is left (unused parameters keep zero gradients).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat gradients of `params`, in order
    offsets: list[int]
    pending: int = 0  # gradients still to arrive in this backward pass
    launched: bool = False
    handle: object = None  # whatever the launch callback returned, waited for in flush()
    state: dict = field(default_factory=dict)  # per-bucket memory of a communication hook
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's gradient: a view of `buffer`

    def numel(self) -> int:
        return self.buffer.numel()


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group trainable parameters, last registered first, into buckets of about `bucket_bytes`."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > bucket_bytes or groups[-1][0].dtype != p.dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


class GradientBuckets:
    """Owns the gradient buffers of `params` and calls `launch(bucket)` as buckets fill.

    `launch` starts the bucket's communication and returns an object with `wait()`;
    `complete(bucket)` (optional) runs after that wait, e.g. to copy a reduced result back;
    `arrive(bucket, param)` (optional) runs when autograd has accumulated `param.grad`, before
    the bucket is counted as nearer ready (ZeRO-2 copies the gradient into a pooled buffer).
    """

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int, launch: Callable[[Bucket], object],
                 complete: Callable[[Bucket], None] | None = None, pad_to: int = 1,
                 arrive: Callable[[Bucket, nn.Parameter], None] | None = None):
        self.params = [p for p in params if p.requires_grad]
        self._launch_fn = launch
        self._complete_fn = complete
        self._arrive_fn = arrive
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        for index, group in enumerate(assign_buckets(self.params, bucket_bytes)):
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            padded = -(-total // pad_to) * pad_to  # room for an even split over pad_to ranks
            buffer = torch.zeros(padded, dtype=group[0].dtype, device=group[0].device)
            views = [buffer[off: off + p.numel()].view_as(p) for p, off in zip(group, offsets)]
            bucket = Bucket(index, group, buffer, offsets, pending=len(group), views=views)
            for p, view in zip(group, views):
                p.grad = view
                self._bucket_of[p] = bucket
            self.buckets.append(bucket)
        self.sync = True  # launch during backward; False while accumulating micro-batches
        self._next = 0  # index of the next bucket to launch
        self.launch_log: list[tuple[int, int, float]] = []  # (bucket, hooks fired so far, time)
        self._hooks_fired = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket_of[param]

    # ------------------------------------------------------------ during backward

    def _on_grad(self, param: nn.Parameter) -> None:
        self._hooks_fired += 1
        bucket = self._bucket_of[param]
        if self._arrive_fn is not None:
            self._arrive_fn(bucket, param)
        bucket.pending -= 1
        if self.sync:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        self.launch_log.append((bucket.index, self._hooks_fired, time.monotonic()))
        bucket.launched = True
        bucket.handle = self._launch_fn(bucket)
        self._next += 1

    @contextlib.contextmanager
    def accumulating(self, last: bool):
        """Around one micro-batch's backward: buckets launch as they fill only in the last one;
        before it, gradients only accumulate locally."""
        self.sync = last
        try:
            yield
        finally:
            if not last:
                self.reset_pass()

    # ------------------------------------------------------------ after backward

    def flush(self) -> None:
        """Launch the buckets not yet launched (in order), wait for all, then reset for the next pass."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            if self._complete_fn is not None:
                self._complete_fn(bucket)
        self.reset_pass()

    def reset_pass(self) -> None:
        """Forget readiness (not gradients): used after flush and after a non-syncing micro-batch."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.handle = None
        self._next = 0
        self._hooks_fired = 0

    def zero_grad(self) -> None:
        """Zero every buffer (one multi-tensor kernel) and point each `.grad` back at its view where
        something replaced it (an identity check: no view is made, nothing is launched)."""
        if self.buckets:
            torch._foreach_zero_([bucket.buffer for bucket in self.buckets])
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
