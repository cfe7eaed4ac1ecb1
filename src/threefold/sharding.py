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

Strided (interleaved) placements: a fused projection (GPT-2's q/k/v in one `c_attn`, gate/up
in one tensor) is `blocks` equal consecutive blocks along `block_dim`; tensor parallelism gives
each rank the same part of every block. Such a placement's box (offsets, shape) is taken in
block coordinates and repeated in each block; the local tensor is the concatenation of those
parts along `block_dim` (`local_shape()`), and a flat range indexes that local tensor. Every
consumer reads placements through `segments()` (global box + where it sits in local storage).
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
    blocks: int = 1  # > 1: a fused tensor of `blocks` blocks along block_dim, the box repeated in each
    block_dim: int = 0

    @staticmethod
    def whole(name: str, shape) -> "Placement":
        shape = tuple(shape)
        return Placement(name, shape, (0,) * len(shape), shape)

    def strided(self, dim: int, blocks: int) -> "Placement":
        """This (whole) box seen as `blocks` equal blocks along `dim` (a fused q/k/v or gate/up tensor):
        later splits cut every block alike."""
        shape = list(self.shape)
        shape[dim] //= blocks
        return replace(self, shape=tuple(shape), blocks=blocks, block_dim=dim)

    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor the box describes (before any flat range)."""
        if self.blocks == 1:
            return tuple(self.shape)
        shape = list(self.shape)
        shape[self.block_dim] *= self.blocks
        return tuple(shape)

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
        return math.prod(self.local_shape())

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The held region as (offsets, shape) boxes in global coordinates, padding clipped.

        A flat range of a box's row-major flattening is a union of at most 2*ndim - 1 boxes.
        """
        return [(seg.offsets, seg.shape) for seg in self.segments()]

    def segments(self) -> list["Segment"]:
        """The held region as global boxes (padding clipped), each with where it sits in local storage."""
        local = self.local_shape()
        if self.flat_range is None:
            runs = [(None, local, (0,) * len(local), local)]
        else:
            strides = _strides(local)
            runs = [(sum(o * s for o, s in zip(off, strides)) - self.flat_range[0], shp, off, shp)
                    for off, shp in flat_range_boxes(local, *self.flat_range)]
        out = []
        for flat_start, run_shape, run_off, run_box in runs:
            for local_off, shp in self._split_blocks(run_off, run_box):
                glob = self._to_global(local_off)
                shp = tuple(max(0, min(o + s, g) - o) for o, s, g in zip(glob, shp, self.global_shape))
                if all(s > 0 for s in shp):
                    inner = tuple(a - b for a, b in zip(local_off, run_off)) if flat_start is not None else local_off
                    out.append(Segment(glob, shp, flat_start, run_shape if flat_start is not None else None, inner))
        return out

    def _split_blocks(self, off, shp):
        """A local box cut at block boundaries along block_dim: [(local offsets, shape)]."""
        if self.blocks == 1:
            return [(tuple(off), tuple(shp))]
        d, part = self.block_dim, self.shape[self.block_dim]
        out, start, end = [], off[d], off[d] + shp[d]
        while start < end:
            stop = min(end, (start // part + 1) * part)
            o, s = list(off), list(shp)
            o[d], s[d] = start, stop - start
            out.append((tuple(o), tuple(s)))
            start = stop
        return out

    def _to_global(self, local_off) -> tuple[int, ...]:
        glob = [a + o for a, o in zip(self.offsets, local_off)]
        if self.blocks > 1:
            d, part = self.block_dim, self.shape[self.block_dim]
            block, within = divmod(local_off[d], part)
            glob[d] = block * (self.global_shape[d] // self.blocks) + self.offsets[d] + within
        return tuple(glob)


@dataclass(frozen=True)
class Segment:
    """One global box a placement holds, and its place in the local storage."""

    offsets: tuple[int, ...]  # global start
    shape: tuple[int, ...]  # extent (clipped to the global shape)
    flat_start: int | None  # flat storage: index of the run's first element in the local 1-D storage
    run_shape: tuple[int, ...] | None  # flat storage: the (unclipped) box the run holds, contiguous
    inner: tuple[int, ...]  # offsets of this box inside the local tensor (or inside the run)

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.shape

    def numel(self) -> int:
        return math.prod(self.shape)

    def view(self, local, place: Placement):
        """The view of `local`'s storage holding this box (writable)."""
        if self.flat_start is None:
            box = local if tuple(local.shape) == place.local_shape() else local.view(place.local_shape())
        else:
            box = local.view(-1)[self.flat_start: self.flat_start + math.prod(self.run_shape)].view(self.run_shape)
        for dim, (o, n) in enumerate(zip(self.inner, self.shape)):
            box = box.narrow(dim, o, n)
        return box


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


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
