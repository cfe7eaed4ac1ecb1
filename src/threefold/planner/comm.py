"""Alpha-beta costs of collectives on the two levels of a GPU cluster.

A message of B bytes over a link costs alpha + B / beta. Collectives over n ranks:
    ring all-reduce      2(n-1) alpha + 2 (n-1)/n B / beta   (reduce-scatter then all-gather)
    tree all-reduce      2 log2(n) alpha + 2 B / beta        (NCCL's double binary tree)
    reduce-scatter       (n-1) alpha + (n-1)/n B / beta       (B = the whole unsharded buffer)
    all-gather           (n-1) alpha + (n-1)/n B / beta       (B = the whole gathered buffer)
    point-to-point       alpha + B / beta
all-reduce takes the cheaper of ring and tree (NCCL picks by size). beta is the GPU kind's link
rate times its `link_efficiency`. A transfer issued as several collectives (gradient buckets, ZeRO-3's
units) pays the latency term once per collective (`in_pieces`).

Placement follows the mesh (mesh.py): axes ordered pp, dp, cp, tp with tp innermost, so a tp group
is `tp` consecutive ranks, a cp group has stride tp, a dp group stride tp*cp (the gradients' replica
group, dp and cp flattened, is dp*cp ranks of stride tp) and the pp neighbours are tp*cp*dp apart. A
group lies inside one node (NVLink/NVSwitch) when stride * size <= GPUs per node; otherwise its
traffic crosses the InfiniBand network, which then bounds it (one NIC per GPU, as in DGX nodes).

Data-parallel and ZeRO collectives (planner/dp_comm.py) are priced over a `Group` instead: NCCL's own
topology-aware ring and tree, as its tuning model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel)
prices them. A group of n ranks on N nodes, L of them on each node:
    ring latency      the ring runs through the L ranks of a node over NVLink and crosses to the next node
                      once per pass: of an all-reduce's 2(n-1) steps 2N cross the network (nInterSteps =
                      2 nNodes), of a reduce-scatter's or all-gather's n-1 steps N-1; the others pay the
                      NVLink step's latency
    tree latency      2((L-1) alpha_intra + log2(N) alpha_inter): a chain inside each node, a double binary
                      tree across nodes (the same file's NCCL_ALGO_TREE term)
    bandwidth         NCCL spreads its channels (one ring or tree each) over the node's NICs: the group's
                      node boundary is crossed through L NICs, so its bus bandwidth is L x the per-GPU
                      network rate (tuning.cc: busBw = nChannels x per-channel bandwidth), capped by
                      NVLink's; inside one node NVLink's
`Group.crossing_bytes` says what of a collective goes over which link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Gpu

# stride of each axis's groups in the (pp, dp, cp, tp) mesh; "replica" is dp and cp flattened (dp+cp)
AXIS_STRIDE = {"tp": lambda tp, dp, cp: 1, "cp": lambda tp, dp, cp: tp, "dp": lambda tp, dp, cp: tp * cp,
               "replica": lambda tp, dp, cp: tp, "pp": lambda tp, dp, cp: tp * cp * dp}


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float


def intra_link(gpu: Gpu) -> Link:
    return Link(gpu.nvlink, gpu.intra_bytes_per_s * gpu.link_efficiency, gpu.intra_latency_s)


def inter_link(gpu: Gpu) -> Link:
    return Link(gpu.infiniband, gpu.inter_bytes_per_s * gpu.link_efficiency, gpu.inter_latency_s)


def axis_link(gpu: Gpu, axis: str, tp: int, dp: int, size: int, cp: int = 1) -> Link:
    """The link that bounds a collective over `axis` of a (pp, dp, cp, tp) mesh."""
    stride = AXIS_STRIDE[axis](tp, dp, cp)
    return intra_link(gpu) if stride * size <= gpu.gpus_per_node else inter_link(gpu)


def ring_all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bytes_per_s


def tree_all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * nbytes / link.bytes_per_s


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    return min(ring_all_reduce(nbytes, n, link), tree_all_reduce(nbytes, n, link))


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bytes_per_s


all_gather = reduce_scatter  # the same traffic in the other direction


def point_to_point(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bytes_per_s


@dataclass(frozen=True)
class Group:
    """A collective's ranks as NCCL sees them: `ranks` in all, `per_node` of them on each node."""

    ranks: int
    per_node: int
    intra: Link
    inter: Link

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.per_node)

    @property
    def bus_bytes_per_s(self) -> float:
        """Bus bandwidth: NVLink's inside a node; across nodes the L NICs of the group's ranks on a node."""
        if self.nodes == 1:
            return self.intra.bytes_per_s
        return min(self.intra.bytes_per_s, self.per_node * self.inter.bytes_per_s)

    def ring_latency(self, steps: int, inter_steps: int) -> float:
        inter_steps = min(steps, inter_steps) if self.nodes > 1 else 0
        return (steps - inter_steps) * self.intra.latency_s + inter_steps * self.inter.latency_s

    def crossing_bytes(self, kind: str, nbytes: float) -> tuple[float, float]:
        """(bytes one rank sends over NVLink, bytes one rank's NIC sends) in a ring `kind` of `nbytes`: a
        node's ranks send (passes)(n-1)/n B each, one hop in L of them leaves the node (through its L NICs)."""
        n, passes = self.ranks, (2 if kind == "all_reduce" else 1)
        sent = passes * (n - 1) / n * nbytes if n > 1 else 0.0
        if self.nodes == 1:
            return sent, 0.0
        return sent * (self.per_node - 1) / self.per_node, sent / self.per_node


def group(gpu: Gpu, stride: int, size: int) -> Group:
    """The group of `size` ranks `stride` apart in the mesh (comm.AXIS_STRIDE): those of one node together."""
    per_node = size if stride * size <= gpu.gpus_per_node else max(1, min(size, gpu.gpus_per_node // stride))
    return Group(size, per_node, intra_link(gpu), inter_link(gpu))


def group_all_reduce(nbytes: float, g: Group) -> float:
    """NCCL's cheaper of its ring and its tree over `g` (tuning.cc: nsteps 2(n-1), nInterSteps 2N)."""
    n = g.ranks
    if n <= 1:
        return 0.0
    ring = g.ring_latency(2 * (n - 1), 2 * g.nodes) + 2 * (n - 1) / n * nbytes / g.bus_bytes_per_s
    tree_latency = 2 * ((g.per_node - 1) * g.intra.latency_s + math.ceil(math.log2(g.nodes)) * g.inter.latency_s)
    return min(ring, tree_latency + 2 * nbytes / g.bus_bytes_per_s)


def group_reduce_scatter(nbytes: float, g: Group) -> float:
    """NCCL's ring reduce-scatter (or all-gather) of `nbytes` over `g`: n-1 steps, N-1 of them across nodes."""
    n = g.ranks
    if n <= 1:
        return 0.0
    return g.ring_latency(n - 1, g.nodes - 1) + (n - 1) / n * nbytes / g.bus_bytes_per_s


group_all_gather = group_reduce_scatter


def hierarchical_all_reduce(nbytes: float, g: Group) -> float:
    """threefold's `compress.hierarchical` (comm/hierarchical.py): reduce over the node's L ranks to its leader,
    all-reduce among the N leaders (one rank, so one NIC, per node), broadcast back over the node. The reduce and
    the broadcast as NCCL's ring prices them (tuning.cc: nsteps = nRanks, algorithm bandwidth = bus bandwidth).
    Where the group is one node or one rank per node it is the plain all-reduce (as the runtime falls back)."""
    if g.nodes == 1 or g.per_node == 1:
        return group_all_reduce(nbytes, g)
    inside = (g.per_node - 1) * g.intra.latency_s + nbytes / g.intra.bytes_per_s
    return 2 * inside + group_all_reduce(nbytes, Group(g.nodes, 1, g.intra, g.inter))


def in_pieces(collective, nbytes: float, pieces: int, *where) -> float:
    """`collective` of `nbytes` in all, issued as `pieces` equal collectives: each pays its latency. `where` is
    what the collective is priced over: (n, link) for the link's, (group,) for a group_* function."""
    pieces = max(1, int(pieces))
    return pieces * collective(nbytes / pieces, *where)
