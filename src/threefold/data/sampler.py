"""The deterministic sampler: global sample index -> window of the token stream.

Sample g of the run is the window of seq_len + 1 tokens starting at offset(seed, g), a pure
function of the seed and g. Step k (0-based) uses samples k*B .. k*B+B-1 in that order, and a
data-parallel rank takes its contiguous slice of them. So every layout sees the same global
batch at every step, and resuming needs nothing but the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A strong 64-bit mixer (Steele et al.): neighbouring inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (b, s) int64
    targets: torch.Tensor  # (b, s) int64: inputs shifted by one


class Sampler:
    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        if tokens.numel() < seq_len + 2:
            raise ValueError(f"the data has {tokens.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self._windows = tokens.numel() - seq_len - 1

    def offset(self, sample: int) -> int:
        return splitmix64((self.seed << 32) ^ sample) % self._windows

    def samples(self, first: int, count: int) -> Batch:
        rows = torch.stack([self.tokens[o: o + self.seq_len + 1] for o in map(self.offset, range(first, first + count))])
        rows = rows.long()
        return Batch(rows[:, :-1], rows[:, 1:])

    def step_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """This data-parallel rank's share of the global batch of `step` (0-based)."""
        per_rank = self.global_batch // dp_size
        return self.samples(step * self.global_batch + dp_rank * per_rank, per_rank)

    def microbatches(self, step: int, count: int, dp_rank: int = 0, dp_size: int = 1,
                     device: torch.device | str = "cpu") -> list[Batch]:
        batch = self.step_batch(step, dp_rank, dp_size)
        return [Batch(i.to(device), t.to(device))
                for i, t in zip(batch.inputs.chunk(count), batch.targets.chunk(count))]
