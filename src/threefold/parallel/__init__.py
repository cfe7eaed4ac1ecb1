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


@dataclass
class ParallelModel:
    module: nn.Module  # this rank's part of the model
    grad_sync: DataParallelReducer  # gradient communication over dp
    placements: dict[str, Placement]  # local parameter name -> where it sits in the global model
    pipeline: object | None = None  # pipeline.PipelineRuntime when pp > 1: supplies forward_backward

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_trainable()]

    @property
    def param_placements(self) -> list[Placement]:
        return [self.placements[n] for n, _ in self.named_trainable()]


def parallelize(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    placements = {name: Placement.whole(name, p.shape) for name, p in model.named_parameters()}
    split = None
    if mesh.size("pp") > 1:
        # 2. pipeline: keep this rank's stages. Names stay global; a weight tied between the first
        # and last stage is held by both, replicated over pp (counted once, at pp coordinate 0).
        from ..pipeline import split_pipeline

        split = split_pipeline(model, mesh, comm, cfg)
        model = split.module
        tied = {id(p) for p in split.tied}
        placements = {}
        for name, p in model.named_parameters():
            place = Placement.whole(split.names[name], p.shape)
            placements[name] = place.replicated("pp") if id(p) in tied else place
    grad_sync = parallelize_data(model, comm, cfg.parallel.bucket_mb)
    placements = {name: place.replicated("dp") for name, place in placements.items()}
    pipeline = split.runtime(comm, grad_sync) if split is not None else None
    return ParallelModel(model, grad_sync, placements, pipeline)
