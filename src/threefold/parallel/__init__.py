"""parallelize(): the one place where strategies are combined, in a fixed, documented order.

    1. tensor parallelism    shard weights over tp by the model's plan          (parallel/tensor.py)
    2. pipeline split        keep this rank's stage(s) of the model              (pipeline/)
    3. activation checkpointing                                                  (parallel/remat.py)
    4. mixed precision       compute dtype, fp32 master weights                  (parallel/precision.py)
    5. gradient sync over dp plain data parallelism or ZeRO 1-3                  (parallel/data.py, zero.py)

Why this order: tensor parallelism replaces modules, so everything after it sees the sharded
model; the pipeline keeps its stages of that model; checkpointing wraps the blocks a rank
still holds; precision casts only what is kept; the gradient sync comes last because it lays
out buckets or shards over the final local parameters in their final dtype. With pp > 1 the
schedule's runtime is built after it, since it drives the sync: ZeRO-2 then reduce-scatters
after the last micro-batch (`defer`), ZeRO-3 reduces per schedule pass the units that pass
reached (`stage_passes`), and the tied first/last-stage weights exchange gradients in the form
the sync holds them (`gradient_of`). See docs/composition.md.

Each step is a function of its own sub-config and the mesh; none imports another strategy.
Step 5 also decides which part of every parameter this rank's optimizer updates (`pieces`):
whole parameters for plain DP, this rank's shards under ZeRO; `make_optimizer` builds the
fp32-master optimizer over them (AdamW or momentum SGD, parallel/master.py), in a host pool
with `parallel.offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from ..comm import Comm
from ..comm.compression import make_comm_hook
from ..config import Config, TrainConfig
from ..mesh import Mesh
from ..sharding import Placement
from .data import parallelize_data
from .master import Piece, ShardedOptimizer
from .precision import MixedPrecision, apply_precision
from .remat import apply_remat
from .tensor_plan import parallelize_tensor
from .zero import ZeroReducer
from .zero3 import Zero3


@dataclass
class ParallelModel:
    module: nn.Module  # this rank's part of the model
    grad_sync: object  # gradient communication over dp: DataParallelReducer, ZeroReducer or Zero3
    placements: dict[str, Placement]  # local parameter name -> where it sits in the global model
    pieces: list[Piece] = field(default_factory=list)  # what this rank's optimizer updates
    precision: MixedPrecision | None = None
    zero: int = 0
    offload: bool = False
    after_step: Callable[[], None] | None = None  # e.g. ZeRO-1/2's all-gather of the updated shards
    remat_regions: list[str] = field(default_factory=list)
    pipeline: object | None = None  # pipeline.PipelineRuntime when pp > 1: supplies forward_backward

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_trainable()]

    @property
    def param_placements(self) -> list[Placement]:
        return [self.placements[n] for n, _ in self.named_trainable()]

    @property
    def scaler(self):
        return self.precision.scaler if self.precision is not None else None

    def make_optimizer(self, cfg: TrainConfig) -> ShardedOptimizer:
        """`cfg.optimizer` with fp32 masters over this rank's pieces (consumes the fp32 initial values).

        A gradient hook that applies the momentum itself before the exchange (DGC's momentum
        correction) gets SGD without momentum: the exchanged sum already is the momentum update.
        """
        if cfg.optimizer == "sgd" and getattr(getattr(self.grad_sync, "hook", None), "applies_momentum", False):
            cfg = replace(cfg, momentum=0.0, nesterov=False)
        fp32_init = self.precision.fp32_init if self.precision is not None else {}
        optimizer = ShardedOptimizer(self.pieces, cfg, fp32_init, self.offload, self.after_step)
        fp32_init.clear()  # the masters hold what is needed; free the whole fp32 copy
        return optimizer

    # ------------------------------------------------------------ memory accounting

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def grad_tensors(self) -> list[torch.Tensor]:
        tensors = getattr(self.grad_sync, "gradient_tensors", None)
        if tensors is not None:
            return tensors()
        return [p.grad for p in self.module.parameters()]

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding weights (excluded from activation accounting)."""
        extra = getattr(self.grad_sync, "weight_tensors", None)
        return list(self.module.parameters()) + list(self.module.buffers()) + (extra() if extra else [])


def parallelize(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    from ..models.plan import decoder_plan  # not at the top: models/plan.py imports the plan styles from here

    # 1. tensor parallelism (placements keyed by global parameter names)
    placements = parallelize_tensor(model, mesh, comm, decoder_plan(cfg.model), cfg.parallel.sequence_parallel)
    # 2. pipeline: keep this rank's stages. Names stay global; a weight tied between the first and
    # last stage is held by both, replicated over pp (counted once, at pp coordinate 0).
    split = None
    if mesh.size("pp") > 1:
        from ..pipeline import split_pipeline

        split = split_pipeline(model, mesh, comm, cfg)
        model = split.module
        tied = {id(q) for q in split.tied}
        placements = {name: placements[split.names[name]].replicated("pp") if id(q) in tied
                      else placements[split.names[name]] for name, q in model.named_parameters()}
    # 3. activation checkpointing
    regions = apply_remat(model, cfg.remat)
    # 4. mixed precision
    precision = apply_precision(model, cfg.precision)
    # 5. gradient sync over dp
    stage, p = cfg.parallel.zero, cfg.parallel
    wire = precision.reduce_dtype
    if stage >= 1 and cfg.compress.method in ("fp16", "bf16"):  # ZeRO's only compression: a 16-bit wire
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.compress.method]
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    if stage == 0:
        hook = make_comm_hook(cfg, mesh.size("dp"), wire if wire != precision.compute_dtype else None)
        grad_sync = parallelize_data(model, comm, p.bucket_mb, hook)
        placements = {name: place.replicated("dp") for name, place in placements.items()}
        pieces = [Piece(name, placements[name], q.detach().view(-1), (lambda q=q: q.grad.view(-1)), q.dim() >= 2)
                  for name, q in named]
        after_step = None
    elif stage in (1, 2):
        # with a pipeline, stage 2 reduce-scatters after the last micro-batch (see zero.py)
        grad_sync = ZeroReducer(named, comm, stage, p.bucket_mb, wire, defer=split is not None)
        pieces = grad_sync.pieces(placements)  # optimizer states: sharded over dp
        placements = {name: place.replicated("dp") for name, place in placements.items()}
        after_step = grad_sync.gather_params
    else:
        # with a pipeline, each schedule pass reduces only the units it reached (see zero3.py)
        grad_sync = Zero3(model, comm, wire, stage_passes=split is not None)
        pieces = grad_sync.pieces(placements)
        placements = grad_sync.placements(placements)
        after_step = None
    parallel = ParallelModel(model, grad_sync, placements, pieces, precision, stage, p.offload == "optimizer",
                             after_step, regions)
    if split is not None:  # the schedule's interpreter, last: it drives the grad sync built above
        parallel.pipeline = split.runtime(comm, grad_sync, precision.compute_dtype, parallel.weight_tensors())
    return parallel
