"""Hierarchical all-reduce: reduce inside each node, all-reduce across nodes, broadcast back.

Links inside a node (NVLink, PCIe, shared memory) are much faster than the network between
nodes, so the sum is formed in three stages over the node axes of the Mesh
(`dp_intra`: the dp peers on this node; `dp_inter`: one dp peer per node):

    1. reduce     over dp_intra to the node's leader (intra coordinate 0)
    2. all-reduce over dp_inter, among the leaders only (one process per node on the network)
    3. broadcast  over dp_intra from the leader

For S bytes, N nodes and L dp ranks per node, the network carries 2 (N-1) S in all (the
leaders' ring), while a flat ring over the N*L ranks crosses the node boundary N times with
2 (NL-1)/(NL) S on each crossing. Comm counts the stages under their own axes, so the
inter-node bytes are `traffic.total_bytes("dp_inter")`.
"""

from __future__ import annotations

import torch

from .collectives import Comm


class _Rest:
    """Stages 2 and 3, run when the caller waits (stage 1 overlaps whatever runs meanwhile)."""

    def __init__(self, comm: Comm, tensor: torch.Tensor, intra: str, inter: str, first):
        self.comm, self.tensor, self.intra, self.inter, self.first = comm, tensor, intra, inter, first
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self.first.wait()
        if self.comm.mesh.rank(self.intra) == 0:
            self.comm.all_reduce(self.tensor, self.inter)
        self.comm.broadcast(self.tensor, self.intra, src=0)
        self._done = True

    def is_completed(self) -> bool:
        return self._done


def hierarchical_all_reduce(comm: Comm, tensor: torch.Tensor, axis: str = "dp", async_op: bool = False):
    """Sum `tensor` in place over `axis` through its node axes `<axis>_intra` / `<axis>_inter`.

    With async_op, returns a handle whose wait() finishes stages 2 and 3.
    """
    intra, inter = f"{axis}_intra", f"{axis}_inter"
    if comm.mesh.size(intra) == 1:  # one dp rank per node: the flat ring is already one per node
        return comm.all_reduce(tensor, inter, async_op=async_op)
    if comm.mesh.size(inter) == 1:  # the whole dp group is on one node
        return comm.all_reduce(tensor, intra, async_op=async_op)
    rest = _Rest(comm, tensor, intra, inter, comm.reduce(tensor, intra, dst=0, async_op=True))
    if not async_op:
        rest.wait()
        return None
    return rest


def dense_all_reduce(comm: Comm, tensor: torch.Tensor, axis: str, hierarchical: bool = False,
                     async_op: bool = False):
    """The uncompressed sum over `axis`: flat ring, or hierarchical through the node axes."""
    if hierarchical:
        return hierarchical_all_reduce(comm, tensor, axis, async_op)
    return comm.all_reduce(tensor, axis, async_op=async_op)
