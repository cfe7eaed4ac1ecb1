"""Synthetic layouts for checkpoint tests: many "ranks" in one process, each a set of placements.

A rank is (coords, {tensor name: Placement}); `materialize` builds the local tensor a real
strategy would hold (padding zero), so saving under one synthetic layout and loading under
another exercises the universal load without processes - tensor-parallel splits with padding,
ZeRO flat shards, replication - before those strategies exist.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from threefold.checkpoint.format import partial_dir_name
from threefold.checkpoint.state import Entry
from threefold.checkpoint.writer import finalize, snapshot, write_rank
from threefold.sharding import Placement


def materialize(full: torch.Tensor, place: Placement) -> torch.Tensor:
    """The local tensor held under `place` (the padded box, or its flat shard), padding zero."""
    box = torch.zeros(place.shape, dtype=full.dtype)
    region = tuple(slice(min(o, g), min(o + s, g)) for o, s, g in zip(place.offsets, place.shape, full.shape))
    inner = tuple(slice(0, r.stop - r.start) for r in region)
    box[inner] = full[region]
    if place.flat_range is None:
        return box
    start, end = place.flat_range
    flat = torch.zeros(end - start, dtype=full.dtype)
    held = box.reshape(-1)[start:end]
    flat[: held.numel()] = held
    return flat


def tp_split(name: str, shape, dim: int, tp: int, padded: int | None = None) -> list[Placement]:
    """tp parts of a tensor along `dim`, padded to `padded` first (a vocabulary padded to a multiple of tp)."""
    whole = Placement.whole(name, shape)
    if padded is not None:
        whole = whole.padded(dim, padded)
    return [whole.split(dim, r, tp).replicated("dp") for r in range(tp)]


def zero_shard(place: Placement, dp: int) -> list[Placement]:
    """ZeRO: the box flattened, padded to a multiple of dp, one equal flat range per dp rank."""
    shard = math.ceil(math.prod(place.shape) / dp)
    unreplicated = replace(place, replicated_over=tuple(a for a in place.replicated_over if a != "dp"))
    return [unreplicated.flat_shard(r * shard, (r + 1) * shard) for r in range(dp)]


def save_synthetic(root: Path, step: int, ranks: list[tuple[dict, dict[str, Placement]]],
                   fulls: dict[str, torch.Tensor], extra: dict | None = None, keep: int = 0) -> Path:
    """Write a checkpoint as the ranks of a synthetic layout would (every rank, then rank 0 finalizes)."""
    root.mkdir(parents=True, exist_ok=True)
    partial = root / partial_dir_name(step)
    partial.mkdir()
    for rank, (coords, places) in enumerate(ranks):
        entries = [Entry(name, materialize(fulls[p.name], p), replace(p, name=name)) for name, p in places.items()]
        write_rank(partial, rank, snapshot(entries, coords), {})
    meta = {"layout": {"world_size": len(ranks)}, "data": {"step": step}, "extra": extra or {}}
    return finalize(partial, step, len(ranks), meta, keep, timeout_s=5)


def local_entries(places: dict[str, Placement], dtype=torch.float32) -> list[Entry]:
    """Entries of one target rank with NaN-filled local storage (so untouched elements show)."""
    out = []
    for name, p in places.items():
        numel = p.flat_range[1] - p.flat_range[0] if p.flat_range else None
        local = torch.full((numel,) if numel is not None else p.shape, float("nan"), dtype=dtype)
        out.append(Entry(name, local, replace(p, name=name)))
    return out
