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
from ..sharding import Placement
from .data import DataParallelReducer, parallelize_data
from .tensor_plan import parallelize_tensor


@dataclass
class ParallelModel:
    module: nn.Module  # this rank's part of the model
    grad_sync: DataParallelReducer  # gradient communication over dp
    placements: dict[str, Placement]  # local parameter name -> where it sits in the global model

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_trainable()]

    @property
    def param_placements(self) -> list[Placement]:
        return [self.placements[n] for n, _ in self.named_trainable()]


def parallelize(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    from ..models.plan import decoder_plan  # not at the top: models/plan.py imports the plan styles from here

    placements = parallelize_tensor(model, mesh, comm, decoder_plan(cfg.model), cfg.parallel.sequence_parallel)
    grad_sync = parallelize_data(model, comm, cfg.parallel.bucket_mb)
    placements = {name: place.replicated("dp") for name, place in placements.items()}
    return ParallelModel(model, grad_sync, placements)
