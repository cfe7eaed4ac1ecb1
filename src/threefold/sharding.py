"""Where a local tensor sits inside the global (single-device) model: the placement contract.

Every strategy that changes what a rank holds records, for each local tensor, a `Placement`:
the global name and shape, the box of the global tensor the local tensor covers (tensor
parallelism cuts boxes; pipeline parallelism keeps or drops whole tensors), and, when the
local storage is a flat shard of that box (ZeRO), the range of the box's row-major
flattening it holds. Checkpoints, gradient norms and exports read placements only, so any
composition of strategies saves, loads and measures correctly without knowing the strategies.

Padding: a box may reach past the global shape (a vocabulary padded to a multiple of tp, a
flat shard padded to a multiple of dp); elements outside the global shape are padding, never
saved and never counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Placement:
    name: str  # global parameter name, e.g. "blocks.3.attn.q.weight"
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # start of the local box in global coordinates
    shape: tuple[int, ...]  # extent of the local box (may reach past global_shape: padding)
    flat_range: tuple[int, int] | None = None  # [start, end) of the box's row-major flattening held here
    replicated_over: tuple[str, ...] = ()  # mesh axes holding identical copies (coordinate 0 is the owner)

    @staticmethod
    def whole(name: str, shape) -> "Placement":
        shape = tuple(shape)
        return Placement(name, shape, (0,) * len(shape), shape)

    def split(self, dim: int, index: int, parts: int) -> "Placement":
        """The part `index` of `parts` equal parts of this box along `dim` (tensor parallelism)."""
        size = self.shape[dim] // parts
        offsets = list(self.offsets)
        shape = list(self.shape)
        offsets[dim] += index * size
        shape[dim] = size
        return replace(self, offsets=tuple(offsets), shape=tuple(shape))

    def padded(self, dim: int, size: int) -> "Placement":
        """The box grown to `size` along `dim` (the extra elements are padding)."""
        shape = list(self.shape)
        shape[dim] = size
        return replace(self, shape=tuple(shape))

    def flat_shard(self, start: int, end: int) -> "Placement":
        """Elements [start, end) of the box's flattening (ZeRO), relative to the current range."""
        base = self.flat_range[0] if self.flat_range else 0
        return replace(self, flat_range=(base + start, base + end))

    def replicated(self, *axes: str) -> "Placement":
        return replace(self, replicated_over=tuple(dict.fromkeys(self.replicated_over + axes)))

    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return math.prod(self.shape)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The held region as (offsets, shape) boxes in global coordinates, padding clipped.

        A flat range of a box's row-major flattening is a union of at most 2*ndim - 1 boxes.
        """
        if self.flat_range is None:
            pieces = [(tuple(self.offsets), tuple(self.shape))]
        else:
            pieces = [(tuple(o + a for o, a in zip(self.offsets, off)), shp)
                      for off, shp in flat_range_boxes(self.shape, *self.flat_range)]
        clipped = []
        for off, shp in pieces:
            shp = tuple(max(0, min(o + s, g) - o) for o, s, g in zip(off, shp, self.global_shape))
            if all(s > 0 for s in shp):
                clipped.append((off, shp))
        return clipped


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Decompose elements [start, end) of a row-major tensor of `shape` into boxes (local coordinates)."""
    total = math.prod(shape)
    start, end = max(0, start), min(end, total)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)
    out = []

    def sub(row, a, b):  # elements [a, b) of row `row`
        return [((row,) + off, (1,) + shp) for off, shp in flat_range_boxes(shape[1:], a, b)]

    if first_row == last_row:
        return sub(first_row, first_col, last_col)
    if first_col:
        out += sub(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:
        out.append(((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row,) + tuple(shape[1:])))
    if last_col:
        out += sub(last_row, 0, last_col)
    return out
