"""parallelize(spec, mesh, comm, cfg): the one place where strategies are combined, in a fixed order.

The model comes as a `ModelSpec` (models/spec.py), the only thing read about it. It is built on
the meta device, so no rank ever holds the whole model:

    0. build                 the single-device module, on the meta device (no storage)
    1. tensor parallelism    shard weights over tp by the model's plan          (parallel/tensor.py)
       expert parallelism    keep this rank's experts of each MoE block, all-to-all dispatch  (parallel/expert.py)
       LoRA                  freeze the model, adapters beside the target linears, split as
                             their base layers (`model.lora_rank`)                  (parallel/lora.py)
    2. pipeline split        keep this rank's stage(s) of the model              (pipeline/)
       materialise           allocate this rank's shards only; fill them from the pretrained
                             weights (reading only those boxes) or the seeded init  (parallel/materialise.py;
                             under ZeRO-3 step 5 fills them a unit at a time, keeping its chunks)
    3. activation checkpointing                                                  (parallel/remat.py)
    4. mixed precision       compute dtype, fp32 master weights                  (parallel/precision.py)
    5. gradient sync over dp plain data parallelism or ZeRO 1-3                  (parallel/data.py, zero.py)
                             (or periodic: local SGD, DiLoCo, EASGD                (parallel/local_sgd.py))
                             (with ep > 1: dense over dp, experts over edp (+cp)  parallel/expert.py)
    6. compile               torch.compile per block and per other top-level module, or per
                             pipeline stage (`train.compile`)                      (parallel/compile.py)

Why this order: tensor parallelism replaces modules, so everything after it sees the sharded
model; the pipeline keeps its stages of that model; checkpointing wraps the blocks a rank
still holds; precision casts only what is kept; the gradient sync comes last because it lays
out buckets or shards over the final local parameters in their final dtype. With pp > 1 the
schedule's runtime is built after it, since it drives the sync: ZeRO-2 then reduce-scatters
after the last micro-batch (`defer`), ZeRO-3 reduces per schedule pass the units that pass
reached (`stage_passes`), and the tied first/last-stage weights exchange gradients in the form
the sync holds them (`gradient_of`). See docs/composition.md.

Each step is a small function in parallel/steps.py that reads its own config section (bound here)
and fills its part of one typed `Build`; `compose(steps, build)` runs them and `finish` builds the
`ParallelModel` once, complete (parallel/compose.py). None imports another strategy. Step 5 is one
entry of the registry of data-parallel sync kinds (parallel/sync_kinds.py); it also decides which
part of every parameter this rank's optimizer updates (`pieces`): whole parameters for plain DP,
this rank's shards under ZeRO; `make_optimizer` builds the
fp32-master optimizer over them (AdamW or momentum SGD, parallel/master.py), in a host pool
with `parallel.offload`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..comm import Comm
from ..config import Config, ParallelConfig
from ..errors import ConfigError
from ..mesh import Mesh
from ..models.spec import ModelSpec
from . import steps
from .comm_hook import make_comm_hook
from .compile import stage_compiler
from .compose import Build, compose, finish
from .lora import check_supported, lora_settings
from .model import GradSync, ParallelModel, accumulate
from .module import parallelize_module
from .nvme import ScratchSettings, return_freed_memory
from .sync_kinds import SyncOptions

__all__ = ["GradSync", "ParallelModel", "accumulate", "parallelize", "parallelize_module"]


def parallelize(spec: ModelSpec, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    """The composition root of a model family: each step of parallel/steps.py bound to its config section, in order."""
    if spec.module_loss is not None:  # a user's own module (py:MODULE:FACTORY): no plan (parallel/module.py)
        if mesh.size("cp") > 1:  # no attention seam to split (config/checks.py refuses it first)
            raise ConfigError("parallel.cp", f"model.preset={cfg.model.preset}: a module of your own has no attention "
                              "context parallelism can split; use parallel.cp=1")
        torch.manual_seed(cfg.train.seed)  # the factory's init, the same on every rank (and broadcast from dp 0)
        return parallelize_module(spec.build(), mesh, comm, cfg, spec.module_loss)
    p, t, partial = cfg.parallel, cfg.train, functools.partial
    if p.offload == "nvme" and p.offload_return_memory:  # freed host buffers back to the system
        return_freed_memory()
    scratch = scratch_settings(p, mesh.global_rank) if p.offload == "nvme" else None
    sp, compile_on, backend, compress = p.sequence_parallel, t.compile, cfg.debug.compile_backend, cfg.compress.method
    tokens = max(1, t.global_batch // (mesh.size("dp") * t.microbatches)) * t.seq_len
    shape = steps.Fp8Shape(tokens, cfg.model.layers, max(1, cfg.model.experts_top_k))
    context = steps.ContextOptions(cfg.data.pack, p.cp_method, t.seq_len, cfg.model.preset)
    options = SyncOptions(p.bucket_mb, p.zero_weight_comm, p.zero_grad_comm, p.zero_hpz, scratch,
                          t if t.periodic else None, partial(make_comm_hook, cfg.compress, t.grad_clip, t.seed))
    # ZeRO-3 fills its units one at a time (no rank ever holds the whole model) where nothing before it reads
    # the values: no fp8 conversion, no family hooks
    defer = p.zero == 3 and cfg.precision.compute not in ("fp8", "mxfp8") and spec.local_hooks is None

    def split(model, mesh, comm, adapter):  # pipeline/split.py reads pipeline.*, train.microbatches, model.*
        from ..pipeline import split_pipeline
        return split_pipeline(model, mesh, comm, cfg, adapter=adapter)

    return finish(compose([
        steps.build_meta,
        partial(steps.tensor, sequence_parallel=sp),
        partial(steps.experts, sequence_parallel=sp),
        partial(steps.lora, settings=lora_settings(cfg.model, t.seed), check=partial(check_supported, parallel=p)),
        partial(steps.pipeline, split_pipeline=split),
        partial(steps.materialise, defer=defer),
        partial(steps.fp8, precision=cfg.precision, shape=shape),
        steps.install_tensor_hooks,
        partial(steps.context, o=context),
        partial(steps.remat, cfg=cfg.remat),
        partial(steps.precision, cfg=cfg.precision),
        partial(steps.replicas, zero=p.zero, compress=compress, options=options,
                matmul_casts=matmul_casts(cfg.precision.compute, p.zero_weight_comm)),
        partial(steps.compile_model, enabled=compile_on, backend=backend),
        partial(steps.pipeline_runtime, compile_stage=stage_compiler(compile_on, backend), compress=compress),
    ], Build(mesh, comm, spec=spec, zero=p.zero, offload=p.offload, scratch=scratch)))


def matmul_casts(compute: str, weight_comm: str):
    """fp8 compute with ZeRO-3's fp8 gather: the weights the gather sends as their matmul's fp8 (zero3.py)."""
    if compute != "fp8" or weight_comm != "fp8":
        return None
    from .fp8 import cast_weight_kernels
    return cast_weight_kernels


def scratch_settings(p: ParallelConfig, rank: int) -> ScratchSettings:
    """parallel.offload=nvme: this rank's scratch files (parallel/scratch.py)."""
    return ScratchSettings(Path(p.offload_dir), p.offload_prefetch, p.offload_block_mb, rank)
