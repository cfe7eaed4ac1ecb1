"""Check that data-parallel replicas hold bit-identical weights.

Replicas apply the same summed gradients with the same optimizer, so their weights must agree
bit for bit; when they do not (a missed gradient sync, a rank-dependent code path, a flipped
bit), every later step trains a different model on each replica. Every `debug.replica_check_every`
steps each rank hashes the parameters its placements mark as replicated over dp (ZeRO shards
are not, and are skipped) - two int64 sums of the raw bits, exact and order-independent - and
one all_gather over dp ("all_gather.replicas") compares them with coordinate 0's.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..mesh import JOIN
from ..sharding import Placement

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergence(RuntimeError):
    """Data-parallel replicas hold different weights."""


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """(sum of bits, sum of squared bits), as int64 with wrap-around: bit-exact and cheap."""
    bits = t.detach().contiguous().view(_BITS[t.element_size()]).reshape(-1).to(torch.int64)
    return torch.stack((bits.sum(), (bits * bits).sum()))


def replicated_params(named_params, placements: dict[str, Placement], axis: str = "dp"):
    """The parameters replicated over `axis` (over each part of a joined axis such as dp+cp)."""
    parts = axis.split(JOIN)
    return [(name, p) for name, p in named_params if all(a in placements[name].replicated_over for a in parts)]


def check_replicas(comm: Comm, named_params: list, step: int, axis: str = "dp") -> list[int]:
    """Raise ReplicaDivergence naming the ranks and first parameter that differ; returns [] if equal."""
    mesh = comm.mesh
    n = mesh.size(axis)
    if n == 1 or not named_params:
        return []
    mine = torch.stack([tensor_hash(p) for _, p in named_params]).to(mesh.device)
    gathered = torch.empty((n * mine.shape[0], 2), dtype=torch.int64, device=mesh.device)
    comm.all_gather(gathered, mine, axis, tag="replicas")
    table = gathered.view(n, -1, 2)
    differ = [i for i in range(1, n) if not torch.equal(table[i], table[0])]
    if differ:
        ranks = mesh.ranks(axis)
        first_rank = differ[0]
        index = int((table[first_rank] != table[0]).any(dim=1).nonzero()[0])
        raise ReplicaDivergence(
            f"after step {step} the {axis} replicas differ: rank{'s' if len(differ) > 1 else ''} "
            f"{','.join(str(ranks[i]) for i in differ)} hold other weights than rank {ranks[0]}; "
            f"first differing parameter: {named_params[index][0]}")
    return []
