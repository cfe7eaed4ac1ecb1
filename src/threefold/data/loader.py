"""Batches prepared ahead on a background thread, so the step does not wait for data.

The sampler is a pure function of the step, so the loader simply computes the batches of the
next `depth` steps while the current one trains: on the host, in pinned memory when the
device is a GPU (the copy to the device is then asynchronous). `get` reports how long the
step waited: for the batch to be ready and for the copy to be issued.

`bound_ids` bounds every step's token ids on the device: the trainer reads the figure it returns
with the step's other figures (no extra wait) and stops the run at an id outside the vocabulary.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .sampler import Batch, Sampler


class Loader:
    def __init__(self, sampler: Sampler, microbatches: int, dp_rank: int, dp_size: int, device: torch.device,
                 depth: int = 2):
        self.sampler, self.microbatches = sampler, microbatches
        self.dp_rank, self.dp_size, self.device, self.depth = dp_rank, dp_size, device, depth
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="threefold-data") if depth > 0 else None
        self._ahead: dict[int, Future] = {}

    def _host(self, step: int) -> list[Batch]:
        batches = self.sampler.step_batch(step, self.dp_rank, self.dp_size).chunk(self.microbatches)
        if self.pin:
            return [b.map(lambda t: t.contiguous().pin_memory()) for b in batches]
        return batches

    def get(self, step: int) -> tuple[list[Batch], float]:
        """The micro-batches of `step` (0-based) on the device, and the seconds spent waiting for them."""
        start = time.perf_counter()
        if self._pool is None:
            host = self._host(step)
        else:
            for ahead in range(step, step + self.depth + 1):
                if ahead not in self._ahead:
                    self._ahead[ahead] = self._pool.submit(self._host, ahead)
            for old in [s for s in self._ahead if s < step]:  # a jump back (not in training)
                self._ahead.pop(old).cancel()
            host = self._ahead.pop(step).result()
        batches = [b.map(lambda t: t.to(self.device, non_blocking=self.pin)) for b in host]
        return batches, time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._ahead.clear()


def bound_ids(batches: list[Batch], vocab: int) -> tuple[list[Batch], torch.Tensor]:
    """(the batches with every id outside [0, vocab) replaced by 0, the step's id figure).

    The figure is a 0-dim device tensor (nothing is read to the host here): the largest id of the
    batches, or the lowest when one is negative, so `0 <= figure < vocab` holds exactly when every id
    is in the vocabulary. The replaced ids let the step run to the read of its figures, which then
    reports the bad id: an embedding lookup past its table would fail first (on a GPU, a
    device-side assert that ends the process without naming the data)."""
    highs = torch.stack([torch.maximum(b.inputs.max(), b.targets.max()) for b in batches]).max()
    lows = torch.stack([torch.minimum(b.inputs.min(), b.targets.min()) for b in batches]).min()
    figure = torch.where(lows < 0, lows, highs)

    for b in batches:  # in place: the step's rows are its own (the sampler stacks them anew each step), and
        for ids in (b.inputs, b.targets):  # inputs and targets stay views of them (what memory accounting counts)
            ids.masked_fill_((ids < 0) | (ids >= vocab), 0)
    return batches, figure
