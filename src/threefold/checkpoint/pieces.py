"""Slice arithmetic: which boxes of a global tensor a local tensor holds, and where in its storage.

A `Placement` (sharding.py) says where a rank's local tensor sits in the global tensor: a box
(tensor parallelism cuts boxes, padding may reach past the global shape) and optionally a
range of the box's row-major flattening (ZeRO flat shards), possibly repeated in the blocks of
a fused tensor (strided). `local_pieces` turns it into pieces - global boxes, padding clipped -
and `local_view` gives the view of the local storage that holds one piece, so saving copies views out and loading copies into them. Saving and
loading under any two layouts then reduce to intersecting boxes (`intersect`).
"""

from __future__ import annotations

import torch

from ..sharding import Placement, Segment

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in global coordinates


Piece = Segment  # a global box held (offsets, shape), and where it sits in the local storage


def local_pieces(place: Placement) -> list[Piece]:
    """The pieces of the global tensor held under `place` (the same boxes as `place.boxes()`)."""
    return place.segments()


def local_view(local: torch.Tensor, place: Placement, piece: Piece) -> torch.Tensor:
    """The view of `local`'s storage that holds `piece` (writable: loading copies into it)."""
    return piece.view(local, place)


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
