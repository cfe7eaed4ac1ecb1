"""Slice arithmetic: which boxes of a global tensor a local tensor holds, and where in its storage.

A `Placement` (sharding.py) says where a rank's local tensor sits in the global tensor: a box
(tensor parallelism cuts boxes, padding may reach past the global shape) and optionally a
range of the box's row-major flattening (ZeRO flat shards). `local_pieces` turns it into
pieces - global boxes, padding clipped - and `local_view` gives the view of the local storage
that holds one piece, so saving copies views out and loading copies into them. Saving and
loading under any two layouts then reduce to intersecting boxes (`intersect`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..sharding import Placement, flat_range_boxes

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in global coordinates


@dataclass(frozen=True)
class Piece:
    offsets: tuple[int, ...]  # global start of the held box
    shape: tuple[int, ...]  # its extent, clipped to the global shape
    flat_start: int | None = None  # flat storage: index in the local 1-D storage of the unclipped box's first element
    flat_shape: tuple[int, ...] | None = None  # flat storage: the unclipped box (contiguous in storage)

    @property
    def box(self) -> Box:
        return self.offsets, self.shape

    def numel(self) -> int:
        return math.prod(self.shape)


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _clip(offsets, shape, global_shape) -> tuple[int, ...]:
    return tuple(max(0, min(o + s, g) - o) for o, s, g in zip(offsets, shape, global_shape))


def local_pieces(place: Placement) -> list[Piece]:
    """The pieces of the global tensor held under `place` (the same boxes as `place.boxes()`)."""
    if place.flat_range is None:
        raw = [(tuple(place.offsets), tuple(place.shape), None, None)]
    else:
        strides = _strides(place.shape)
        raw = []
        for off, shp in flat_range_boxes(tuple(place.shape), *place.flat_range):
            ravel = sum(o * s for o, s in zip(off, strides))
            raw.append((tuple(a + o for a, o in zip(place.offsets, off)), shp, ravel - place.flat_range[0], shp))
    pieces = []
    for offsets, shape, flat_start, flat_shape in raw:
        clipped = _clip(offsets, shape, place.global_shape)
        if all(s > 0 for s in clipped):
            pieces.append(Piece(offsets, clipped, flat_start, flat_shape))
    return pieces


def local_view(local: torch.Tensor, place: Placement, piece: Piece) -> torch.Tensor:
    """The view of `local`'s storage that holds `piece` (writable: loading copies into it)."""
    if piece.flat_start is None:
        box = local if tuple(local.shape) == tuple(place.shape) else local.view(place.shape)
        for dim, (o, base, n) in enumerate(zip(piece.offsets, place.offsets, piece.shape)):
            box = box.narrow(dim, o - base, n)
        return box
    flat = local.view(-1)
    run = flat[piece.flat_start: piece.flat_start + math.prod(piece.flat_shape)].view(piece.flat_shape)
    for dim, n in enumerate(piece.shape):  # clipping only shortens the far end of each dimension
        run = run.narrow(dim, 0, n)
    return run


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, None when they do not overlap."""
    offsets = tuple(max(ao, bo) for ao, bo in zip(a[0], b[0]))
    ends = tuple(min(ao + ae, bo + be) for ao, ae, bo, be in zip(a[0], a[1], b[0], b[1]))
    shape = tuple(e - o for o, e in zip(offsets, ends))
    if any(s <= 0 for s in shape):
        return None
    return offsets, shape


def relative(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of `box` inside a tensor whose element 0 sits at global `origin`."""
    return tuple(slice(o - base, o - base + n) for o, base, n in zip(box[0], origin, box[1]))


def holds_origin(place: Placement) -> bool:
    """Whether the local tensor holds the global tensor's first element (writer of its scalar states)."""
    return any(all(o == 0 for o in piece.offsets) for piece in local_pieces(place))


def is_owner(place: Placement, coords: dict[str, int]) -> bool:
    """A replicated copy is written by coordinate 0 of each axis it is replicated over."""
    return all(coords.get(axis, 0) == 0 for axis in place.replicated_over)
