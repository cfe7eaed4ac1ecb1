"""A few whole-bucket buffers that ZeRO-2 fills in turn (DeepSpeed's "ipg" buffers).

ZeRO-2 needs a gradient bucket whole only from the first gradient of a backward pass that lands
in it until its reduce-scatter is done. Rather than every bucket re-allocating (and zeroing) its
own memory every pass, the buckets of a step take byte buffers of the largest bucket's size from
this pool, viewed as the bucket's dtype and length, and give them back once their reduce-scatter
was waited for. The pool never decides when a collective is done: the caller gives a buffer
back only after waiting, so a buffer in flight is never handed out again.

The pool holds `size` buffers; `take()` answers None when all are out (the caller then completes
its oldest reduce-scatter in flight, which gives one back), and `grow()` adds one when none can
be freed (every buffer out belongs to a bucket still filling). `release()` frees the buffers'
memory at the end of a step, so between steps a rank holds only its gradient shards; the next
step allocates them again, once each, however many buckets and micro-batches it has.
"""

from __future__ import annotations

import torch

DEFAULT_SIZE = 2  # one bucket filling while the previous one is reduce-scattered


class BufferPool:
    def __init__(self, nbytes: int, device: torch.device, size: int = DEFAULT_SIZE):
        self.nbytes, self.device, self.size = nbytes, device, size
        self.buffers: list[torch.Tensor] = []  # every buffer of the pool (uint8, `nbytes` each)
        self.free: list[torch.Tensor] = []
        self.allocations = 0  # times a buffer's memory was allocated (a new buffer or after release)

    def take(self) -> torch.Tensor | None:
        """A free buffer (its memory allocated), or None when all `size` buffers are out."""
        if not self.free:
            if len(self.buffers) >= self.size:
                return None
            return self.grow()
        buffer = self.free.pop()
        if buffer.untyped_storage().nbytes() == 0:
            buffer.untyped_storage().resize_(self.nbytes)
            self.allocations += 1
        return buffer

    def grow(self) -> torch.Tensor:
        """One more buffer, out at once (for when every buffer out belongs to a bucket still filling)."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.buffers.append(buffer)
        self.allocations += 1
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """`buffer`'s collective was waited for: it may be handed out again."""
        self.free.append(buffer)

    def release(self) -> None:
        """Free every buffer's memory (all given back): the pool holds nothing until the next `take()`."""
        assert len(self.free) == len(self.buffers), "a pooled bucket buffer is still out"
        for buffer in self.buffers:
            buffer.untyped_storage().resize_(0)


def view(buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `numel` elements of `dtype` of a pooled byte buffer."""
    return buffer[: numel * dtype.itemsize].view(dtype)
