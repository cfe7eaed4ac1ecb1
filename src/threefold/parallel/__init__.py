"""parallelize(): the one place where strategies are combined, in a fixed, documented order.

    1. tensor parallelism    shard weights over tp by the model's plan          (parallel/tensor.py)
    2. pipeline split        keep this rank's stage(s) of the model              (pipeline/)
    3. activation checkpointing                                                  (parallel/remat.py)
    4. mixed precision       compute dtype, fp32 master weights                  (parallel/precision.py)
    5. gradient sync over dp plain data parallelism or ZeRO 1-3                  (parallel/data.py, zero.py)

Each step is a function of its own sub-config and the mesh; none imports another strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..comm import Comm
from ..config import Config
from ..mesh import Mesh
from .data import DataParallelReducer, parallelize_data


@dataclass
class ParallelModel:
    module: nn.Module  # this rank's part of the model
    grad_sync: DataParallelReducer  # gradient communication over dp
    params: list[nn.Parameter]  # trainable parameters this rank updates
    norm_axes: tuple[str, ...] = ()  # axes over which gradient-norm contributions are summed


def parallelize(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    grad_sync = parallelize_data(model, comm, cfg.parallel.bucket_mb)
    return ParallelModel(model, grad_sync, [p for p in model.parameters() if p.requires_grad])
