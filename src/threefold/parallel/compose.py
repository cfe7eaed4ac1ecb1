"""`compose(steps, build)`: the one composition root. Each step reads its own config section (bound by
the caller, `parallelize` or `parallelize_module`) and fills its part of one typed `Build`; `finish`
then builds the `ParallelModel` once, complete.

    Build.model          this rank's module as the steps leave it
    Build.placements     local parameter name -> where it sits in the global model
    Build.shards         tensor parallelism's gradient hooks, installed once the parameters have storage
    Build.split          the pipeline split (pp > 1), whose runtime is built last (`steps.pipeline_runtime`)
    Build.sync           the data-parallel sync kind's result (parallel/sync_kinds.py `DpSync`)
    ...                  the rest: what `ParallelModel` holds (routers, regions, precision, documents, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from torch import nn

from ..comm import Comm
from ..mesh import Mesh
from ..sharding import Placement
from .materialise import Deferred
from .model import Documents, ParallelModel, Scratch
from .nvme import ScratchSettings
from .precision import MixedPrecision
from .remat import ActivationOffload
from .sync_kinds import DpSync
from .tensor_plan import TensorShards


@dataclass
class Build:
    """What the steps hand on, each filling its own fields."""

    mesh: Mesh
    comm: Comm
    model: nn.Module | None = None
    spec: object | None = None  # the models.spec.ModelSpec (its LoRA form once the lora step ran)
    placements: dict[str, Placement] = field(default_factory=dict)
    shards: TensorShards | None = None  # tp: the gradient hooks to install (tensor step)
    routers: bool = False  # mixture-of-experts routers in the model (experts step)
    expert_names: set[str] = field(default_factory=set)  # parameters spread over ep (experts step)
    lora_base: object | None = None  # parallel/lora.py LoraBase (lora step)
    split: object | None = None  # pipeline.PipelineSplit (pipeline step)
    deferred: Deferred | None = None  # ZeRO-3 fills the parameters unit by unit (materialise step)
    allocated: int = 0  # model-tensor bytes this rank allocated while starting
    documents: Documents | None = None  # packed rows (context step)
    units: list[tuple[str, nn.Module]] | None = None  # a user's module: ZeRO-3's and remat's units
    regions: list[str] = field(default_factory=list)  # activation-checkpointed regions (remat step)
    activation_offload: ActivationOffload | None = None
    precision: MixedPrecision | None = None  # precision step
    sync: DpSync | None = None  # replicas step
    pipeline: object | None = None  # pipeline.PipelineRuntime (pipeline_runtime step)
    after_sync: Callable[[], None] | None = None  # the tied weights' sum after a lossy dp wire
    zero: int = 0  # parallel.zero, as ParallelModel reports it
    offload: str = "none"  # parallel.offload
    scratch: ScratchSettings | None = None  # parallel.offload=nvme: where the optimizer states stream from


Step = Callable[[Build], None]


def compose(steps: Iterable[Step], build: Build) -> Build:
    """Run the steps in order over `build`; each fills its own part of it."""
    for step in steps:
        step(build)
    return build


def weight_tensors(b: Build) -> list:
    """Every tensor holding weights (ParallelModel.weight_tensors, before there is one: the pipeline's meter)."""
    return list(b.model.parameters()) + list(b.model.buffers()) + b.sync.grad_sync.weight_tensors()


def finish(b: Build, cls: type[ParallelModel] = ParallelModel, **extra) -> ParallelModel:
    """The `ParallelModel` (or `cls`, with its `extra` fields) of a composed build: built once, complete."""
    s = b.sync
    return cls(b.model, s.grad_sync, s.placements, s.pieces, b.precision, b.zero, b.offload != "none", s.after_step,
               b.regions, pipeline=b.pipeline, spec=b.spec, materialised_bytes=b.allocated, periodic=s.periodic,
               routers=b.routers, settle_weights=s.settle, after_sync=b.after_sync,
               activation_offload=b.activation_offload, replica_axis=b.mesh.replica_axis, lora_base=b.lora_base,
               scratch=None if b.scratch is None else Scratch(b.scratch, s.shard_home, s.grad_home),
               documents=b.documents, comm=b.comm, **extra)
