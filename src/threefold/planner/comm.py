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


def in_pieces(collective, nbytes: float, pieces: int, n: int, link: Link) -> float:
    """`collective` of `nbytes` in all, issued as `pieces` equal collectives: each pays its latency."""
    pieces = max(1, int(pieces))
    return pieces * collective(nbytes / pieces, n, link)
