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
ZeRO-3 does. Slices are dropped when the unit's gradients are reduced (and at the end of a
pass), except under a pipeline schedule, where other micro-batches' backwards still use them.

Memory: between a forward and its backward every unit holds its slice: W/L elements per rank
(W = the padded parameters), beside the primary shard of W/N: with N = M nodes x L, M times
the primary shard. `peak_numel` records it.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..errors import ConfigError

AXIS = "dp_intra"


class SecondaryPartition:
    """Each ZeRO-3 unit's node-local slice of its whole (gathered) weights."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.size, self.rank = comm.mesh.size(AXIS), comm.mesh.rank(AXIS)
        self._slices: dict[int, tuple[torch.Tensor, int]] = {}  # unit index -> (slice, shard version)
        self.numel = 0
        self.peak_numel = 0

    def keep(self, index: int, shard: torch.Tensor, whole: torch.Tensor) -> None:
        """Keep this rank's slice of a unit's whole flat weights, gathered from `shard`'s current values."""
        self.drop(index)
        piece = whole.view(self.size, -1)[self.rank].clone()
        self._slices[index] = (piece, shard._version)
        self.numel += piece.numel()
        self.peak_numel = max(self.peak_numel, self.numel)

    def ready(self, index: int, shard: torch.Tensor) -> bool:
        entry = self._slices.get(index)
        return entry is not None and entry[1] == shard._version

    def gather(self, index: int, whole: torch.Tensor):
        """Start the all-gather of a unit's slices over the node into `whole`; returns its handle."""
        return self.comm.all_gather(whole, self._slices[index][0], AXIS, async_op=True)

    def drop(self, index: int) -> None:
        entry = self._slices.pop(index, None)
        if entry is not None:
            self.numel -= entry[0].numel()

    def clear(self) -> None:
        self._slices.clear()
        self.numel = 0


def secondary_partition(comm: Comm) -> SecondaryPartition:
    """hpZ over this Mesh's node axes; a user error where it cannot help (one node, or one dp rank per node)."""
    mesh = comm.mesh
    if not mesh.has_node_axes() or mesh.size("dp_inter") == 1:
        raise ConfigError("parallel.zero_hpz", f"all {mesh.size('dp')} dp ranks are on one node, so ZeRO-3's "
                          "gathers never leave it and a node-local copy only costs memory; drop parallel.zero_hpz")
    if mesh.size(AXIS) == 1:
        raise ConfigError("parallel.zero_hpz", "each node holds one dp rank, so the node-local copy would be the "
                          "whole model on every rank; drop parallel.zero_hpz (or put several dp ranks on a node)")
    return SecondaryPartition(comm)
