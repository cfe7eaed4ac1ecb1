"""The device mesh: named axes pp x dp x tp over torch's DeviceMesh.

The Mesh is the only owner of process groups. It is built once per job and passed to every
strategy, which asks it for `group("tp")`, `rank("pp")`, `size("dp")`. The axis order puts tp
innermost, so tensor-parallel ranks are consecutive global ranks (the same node under the
usual launchers, where its frequent collectives belong), then dp, then pp outermost.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .launch import free_port

AXES = ("pp", "dp", "tp")


def pick_device(kind: str = "auto") -> torch.device:
    """cuda:LOCAL_RANK when CUDA is present (or asked for), else the CPU."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the world described by the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR...).

    A lone process with no launcher becomes a world of one. NCCL drives CUDA, gloo the CPU.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}"


class Mesh:
    """Process groups and coordinates for the axes pp, dp, tp of the current world."""

    def __init__(self, layout: Layout, device: torch.device):
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(f"layout {layout} needs {layout.world_size} processes, the world has {world}")
        self.layout = layout
        self.device = device
        self.device_mesh: DeviceMesh = init_device_mesh(
            device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=AXES)
        self._groups = {axis: self.device_mesh.get_group(axis) for axis in AXES}

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def size(self, axis: str) -> int:
        return getattr(self.layout, axis)

    def rank(self, axis: str) -> int:
        """This process's coordinate along `axis` (0 .. size-1)."""
        return self.device_mesh.get_local_rank(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this process's group along `axis`, ordered by coordinate."""
        return dist.get_process_group_ranks(self._groups[axis])

    def global_rank_of(self, axis: str, index: int) -> int:
        """Global rank of the member with coordinate `index` along `axis` in this process's group."""
        return self.ranks(axis)[index]

    def is_first(self, axis: str) -> bool:
        return self.rank(axis) == 0

    def is_last(self, axis: str) -> bool:
        return self.rank(axis) == self.size(axis) - 1

    def __repr__(self) -> str:
        coords = " ".join(f"{a}={self.rank(a)}/{self.size(a)}" for a in AXES)
        return f"Mesh(rank {self.global_rank}: {coords}, {self.device})"
