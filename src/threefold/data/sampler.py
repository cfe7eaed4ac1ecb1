"""The deterministic sampler: global sample index -> sequence of seq_len + 1 token ids.

Sample g of the run is a pure function of the seed and g: a window at offset(seed, g) of an
in-memory token stream (`Windows`: synthetic, stdlib, raw files), or the g-th sequence of the
epochs of a prepared directory or a mixture of them (epochs.py). Step k (0-based) uses
samples k*B .. k*B+B-1 in that order, and a data-parallel rank takes its contiguous slice of
them. So every layout sees the same global batch at every step, and resuming needs nothing
but the step number.

Packed (`data.pack`, `PackedSampler`): sample g is the g-th packed row of whole documents
(epochs.py `PackedEpochs`, data/packing.py), and every batch carries a `Packing`: the document
id and position of each input token and which targets count (not padding, not the first token
of the next document).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .packing import Packed

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A strong 64-bit mixer (Steele et al.): neighbouring inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Packing:
    """What a batch of packed rows adds, per input token (each (b, s), like the inputs)."""

    documents: torch.Tensor  # int64: the document id (0, 1, ... per row; padding one more id)
    positions: torch.Tensor  # int64: the position in its document (0 at each document's first token)
    counted: torch.Tensor  # bool: the target counts in the loss (not padding, not the next document's first)

    def chunk(self, count: int) -> list["Packing"]:
        return [Packing(*parts) for parts in zip(self.documents.chunk(count), self.positions.chunk(count),
                                                 self.counted.chunk(count))]

    def map(self, fn) -> "Packing":
        """Every tensor through `fn` (a copy to the device, pinning, a split of the sequence)."""
        return Packing(fn(self.documents), fn(self.positions), fn(self.counted))


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (b, s) int64
    targets: torch.Tensor  # (b, s) int64: inputs shifted by one
    packing: Packing | None = None  # packed rows (data.pack): documents, positions, counted targets

    def chunk(self, count: int) -> list["Batch"]:
        """`count` micro-batches of the rows (torch's `chunk`: views)."""
        inputs, targets = self.inputs.chunk(count), self.targets.chunk(count)
        packings = self.packing.chunk(count) if self.packing is not None else [None] * len(inputs)
        return [Batch(i, t, p) for i, t, p in zip(inputs, targets, packings)]

    def map(self, fn) -> "Batch":
        """Every tensor through `fn`."""
        return Batch(fn(self.inputs), fn(self.targets), None if self.packing is None else self.packing.map(fn))


class SampleSource(Protocol):
    def sample(self, g: int) -> np.ndarray | torch.Tensor:
        """The seq_len + 1 token ids of global sample g."""

    def state(self, samples: int) -> dict:
        """The data position after `samples` samples, for checkpoints (epoch, position, ...)."""


class Windows:
    """Sample g = the window at a random offset(seed, g) of one token stream (with replacement)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        if tokens.numel() < seq_len + 2:
            raise ValueError(f"the data has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self._windows = tokens.numel() - seq_len - 1

    def offset(self, sample: int) -> int:
        return splitmix64((self.seed << 32) ^ sample) % self._windows

    def sample(self, g: int) -> torch.Tensor:
        o = self.offset(g)
        return self.tokens[o: o + self.seq_len + 1]

    def state(self, samples: int) -> dict:
        return {}


class Sampler:
    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        self._setup(Windows(tokens, seq_len, seed), seq_len, global_batch)

    @classmethod
    def from_source(cls, source: SampleSource, seq_len: int, global_batch: int) -> "Sampler":
        sampler = cls.__new__(cls)
        sampler._setup(source, seq_len, global_batch)
        return sampler

    def _setup(self, source: SampleSource, seq_len: int, global_batch: int) -> None:
        self.source, self.seq_len, self.global_batch = source, seq_len, global_batch

    def samples(self, first: int, count: int) -> Batch:
        rows = [torch.as_tensor(self.source.sample(g)) for g in range(first, first + count)]
        rows = torch.stack(rows).long()
        return Batch(rows[:, :-1], rows[:, 1:])

    def step_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """This data-parallel rank's share of the global batch of `step` (0-based)."""
        per_rank = self.global_batch // dp_size
        return self.samples(step * self.global_batch + dp_rank * per_rank, per_rank)

    def state(self, steps: int) -> dict:
        """The layout-independent data position after `steps` steps."""
        return self.source.state(steps * self.global_batch)

    def microbatches(self, step: int, count: int, dp_rank: int = 0, dp_size: int = 1,
                     device: torch.device | str = "cpu") -> list[Batch]:
        return [mb.map(lambda t: t.to(device)) for mb in self.step_batch(step, dp_rank, dp_size).chunk(count)]


class PackedSource(Protocol):
    def row(self, g: int) -> Packed:
        """Global sample g: one packed row of seq_len + 1 tokens (whole documents, padding)."""

    def state(self, samples: int) -> dict:
        """The data position after `samples` samples, for checkpoints."""


class PackedSampler(Sampler):
    """Sample g = the g-th packed row of documents (`PackedSource`); batches carry their `Packing`."""

    def __init__(self, source: PackedSource, seq_len: int, global_batch: int):
        self.rows = source
        self._setup(source, seq_len, global_batch)

    def samples(self, first: int, count: int) -> Batch:
        rows = [self.rows.row(g) for g in range(first, first + count)]
        tokens, documents = torch.cat([r.tokens for r in rows]), torch.cat([r.documents for r in rows])
        positions, real = torch.cat([r.positions for r in rows]), torch.cat([r.real for r in rows])
        counted = real[:, 1:] & (documents[:, 1:] == documents[:, :-1])
        return Batch(tokens[:, :-1], tokens[:, 1:], Packing(documents[:, :-1], positions[:, :-1], counted))
