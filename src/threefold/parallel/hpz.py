"""hpZ (after ZeRO++): a secondary copy of each ZeRO-3 unit's weights, sharded inside the node.

ZeRO-3 gathers every unit twice per micro-batch over the whole dp group: once in the forward and
once again in the backward. With `parallel.zero_hpz=true` the forward's gather also leaves, on
each rank, its 1/L slice of the whole unit (L = the dp ranks of its node, the `dp_intra` axis of
the Mesh). The backward's re-gather is then an all-gather of those slices over `dp_intra` only:
no byte of it crosses the network between nodes. The weights do not change between a forward
and its backward, so the backward sees exactly the values the forward gathered (bitwise, also
with `zero_weight_comm=int8|fp8`: the slices keep the dequantized values and move unquantized
inside the node).

A slice is valid while the unit's shard is unchanged (its version counter: an optimizer step or
a checkpoint load bumps it); a backward that finds no valid slice gathers over dp as plain
ZeRO-3 does. A slice is dropped once the backward has gathered its unit, except under a
pipeline schedule, where other micro-batches' backwards use it again (it stays until the
weights change and the next forward replaces it).

Memory: between a forward and its backward every unit holds its slice: W/L elements per rank
(W = the padded parameters), beside the primary shard of W/N: with N = M nodes x L, M times
the primary shard. `peak_numel` records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..comm import Comm
from ..errors import ConfigError


class PaddedParam(Protocol):
    padded: torch.Tensor  # the whole parameter's padded storage (N x chunk elements)


class Unit(Protocol):
    """What the node-local copy reads of a ZeRO-3 unit (parallel/zero3.py's `Unit`)."""

    index: int
    params: Sequence[PaddedParam]
    shard_flat: torch.Tensor  # this rank's shards of the unit, one flat buffer

AXIS = "dp_intra"


class NoPartition:
    """Plain ZeRO-3: no node-local copy; every gather is over dp."""

    def keep(self, units: list[Unit], grad_enabled: bool) -> None:
        pass

    def ready(self, unit: Unit) -> bool:
        return False


NO_HPZ = NoPartition()


class SecondaryPartition(NoPartition):
    """Each ZeRO-3 unit's node-local slice of its whole (gathered) weights; `reuse`: keep a slice after
    the backward gathered from it (pipeline schedules, whose backward passes interleave with forwards)."""

    def __init__(self, comm: Comm, reuse: bool = False):
        self.comm, self.reuse = comm, reuse
        self.size, self.rank = comm.mesh.size(AXIS), comm.mesh.rank(AXIS)
        self._slices: dict[int, tuple[torch.Tensor, list[int], int]] = {}  # unit -> (slices, sizes, version)
        self.numel = 0
        self.peak_numel = 0

    @torch.no_grad()
    def keep(self, units: list[Unit], grad_enabled: bool) -> None:
        """After a forward gathered `units` (whole now): keep this rank's slice of each, unless a
        backward will not follow (`grad_enabled` False) or the slice is already current."""
        if not grad_enabled:
            return
        for unit in units:
            if not unit.params or self.ready(unit):
                continue
            self._drop(unit.index)
            pieces = [sp.padded.view(self.size, -1)[self.rank] for sp in unit.params]
            self._slices[unit.index] = (torch.cat(pieces), [p.numel() for p in pieces], unit.shard_flat._version)
            self.numel += sum(p.numel() for p in pieces)
            self.peak_numel = max(self.peak_numel, self.numel)

    def ready(self, unit: Unit) -> bool:
        entry = self._slices.get(unit.index)
        return entry is not None and entry[2] == unit.shard_flat._version

    def gather(self, unit: Unit) -> _Holding:
        """All-gather the unit's slices over the node into its parameters' whole storage (already sized)."""
        flat, sizes, _ = self._slices[unit.index]
        if not self.reuse:
            self._drop(unit.index)
        handle = self.comm.all_gather_many([sp.padded for sp in unit.params], list(flat.split(sizes)), AXIS)
        return _Holding(handle, flat)

    def _drop(self, index: int) -> None:
        entry = self._slices.pop(index, None)
        if entry is not None:
            self.numel -= entry[0].numel()


class _Holding:
    """A gather's handle, keeping its source alive until it is waited for."""

    def __init__(self, handle, source: torch.Tensor):
        self.handle, self.source = handle, source

    def wait(self) -> None:
        self.handle.wait()
        self.source = None

    def is_completed(self) -> bool:
        return self.handle.is_completed()


def secondary_partition(comm: Comm, pipelined: bool) -> SecondaryPartition:
    """hpZ over this Mesh's node axes; a user error where it cannot help (one node, or one dp rank per node)."""
    mesh = comm.mesh
    if not mesh.has_node_axes() or mesh.size("dp_inter") == 1:
        raise ConfigError("parallel.zero_hpz", f"all {mesh.size('dp')} dp ranks are on one node, so ZeRO-3's "
                          "gathers never leave it and a node-local copy only costs memory; drop parallel.zero_hpz")
    if mesh.size(AXIS) == 1:
        raise ConfigError("parallel.zero_hpz", "each node holds one dp rank, so the node-local copy would be the "
                          "whole model on every rank; drop parallel.zero_hpz (or put several dp ranks on a node)")
    return SecondaryPartition(comm, reuse=pipelined)
