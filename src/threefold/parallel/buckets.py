"""Gradient buckets: flat buffers that gradients accumulate into, launched as they fill.

Shared machinery of the data-parallel reducer and ZeRO stages 1 and 2: between backward passes
each parameter's `.grad` is a view into its bucket's flat buffer (torch DDP's
gradient_as_bucket_view), so a full bucket is one contiguous tensor ready for one collective, and
the optimizer, the norm and the clip read the buffers with no copy.

Within a pass, gradients land in the bucket one multi-tensor operation per bucket, not one per
parameter. `begin_pass()` (entering `accumulating`) sets every `.grad` to None, so autograd's
AccumulateGrad hands each new gradient over as it is (it steals the tensor: no operation) instead
of adding it into the view (one `add_` per parameter and micro-batch, which is what DDP's bucket
views cost). When the last gradient of a bucket has arrived the bucket is *merged*: one
`_foreach_add_` adds every new gradient into its view (the buffer holds the earlier micro-batches'
sum, zeros after `zero_grad`), and each `.grad` is the view again. A gradient that arrives with
`.grad` still its view (a backward outside `accumulating`) is added by autograd as before and the
merge skips it. Until its bucket is merged a gradient is held on its own: at most the bucket
being filled, as with DDP without bucket views, and released at the merge.

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
    `merge(bucket)` (optional; default `merge_into_buffer`) takes the gradients autograd handed
    over in this pass (`.grad` not the view) once the bucket's last one arrived (ZeRO-2 copies
    them into a pooled buffer instead).
    """

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int, launch: Callable[[Bucket], object],
                 complete: Callable[[Bucket], None] | None = None, pad_to: int = 1,
                 merge: Callable[[Bucket], None] | None = None):
        self.params = [p for p in params if p.requires_grad]
        self._launch_fn = launch
        self._complete_fn = complete
        self._merge_fn = merge or self.merge_into_buffer
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

    def begin_pass(self) -> None:
        """Before a backward pass: no `.grad`, so autograd hands each new gradient over without adding it."""
        for p in self.params:
            p.grad = None

    def _on_grad(self, param: nn.Parameter) -> None:
        self._hooks_fired += 1
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if bucket.pending <= 0:  # the bucket's last gradient (or a late one): into the buffer
            self._merge_fn(bucket)
        if self.sync:
            self._launch_ready()

    @staticmethod
    def handed_over(bucket: Bucket) -> list[int]:
        """Indices of the bucket's parameters whose `.grad` autograd set in this pass (not the view)."""
        return [i for i, (p, view) in enumerate(zip(bucket.params, bucket.views))
                if p.grad is not None and p.grad is not view]

    @staticmethod
    def merge_into_buffer(bucket: Bucket) -> None:
        """Add the gradients handed over into their views (one multi-tensor add); every `.grad` is its view."""
        new = GradientBuckets.handed_over(bucket)
        if new:
            torch._foreach_add_([bucket.views[i] for i in new], [bucket.params[i].grad for i in new])
        for p, view in zip(bucket.params, bucket.views):
            p.grad = view

    def merge_all(self) -> None:
        """Merge what is still held apart (a bucket some parameter of which had no gradient in this pass)."""
        for bucket in self.buckets:
            if self.handed_over(bucket):
                self._merge_fn(bucket)

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
        self.begin_pass()
        try:
            yield
        finally:
            if not last:
                self.merge_all()
                self.reset_pass()

    # ------------------------------------------------------------ after backward

    def flush(self) -> None:
        """Launch the buckets not yet launched (in order), wait for all, then reset for the next pass."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.pending > 0:  # some parameter had no gradient: what arrived is still apart
                self._merge_fn(bucket)
            self._launch(bucket)
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
