"""The strategy steps `parallelize` composes (parallel/compose.py), in their order. Each reads its own
config section or settings (bound by `parallelize` with functools.partial) and fills its part of the
`Build`; none imports another strategy's step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

from ..config.sections import PrecisionConfig, RematConfig
from ..errors import ConfigError
from ..mesh import REPLICA
from ..models.meta import on_meta
from ..models.moe import moe_modules
from .compile import apply_compile
from .compose import Build, weight_tensors
from .context import install_context, install_documents
from .expert import context_parallel_experts, sequence_parallel_experts, shard_experts
from .lora import LoraBase, add_adapters, lora_spec
from .materialise import defer_parameters, materialise as materialise_model
from .precision import apply_precision
from .remat import apply_offload, apply_remat
from .sync_kinds import SyncInput, SyncOptions, kind_name, wire_dtype, wrap
from .tensor_plan import shard_tensor

LOSSY_WIRES = ("dgc", "onebit", "powersgd")  # dp gradient exchanges that are not an exact sum


def build_meta(b: Build) -> None:
    """0. the whole model, without storage."""
    with on_meta():
        b.model = b.spec.build()


def tensor(b: Build, sequence_parallel: bool) -> None:
    """1. tensor parallelism (placements keyed by global names; its gradient hooks installed once the
    parameters have storage: `install_tensor_hooks`)."""
    b.shards = shard_tensor(b.model, b.mesh, b.comm, b.spec.plan(b.mesh.size("tp")), sequence_parallel)
    b.placements = b.shards.placements


def experts(b: Build, sequence_parallel: bool) -> None:
    """1b. expert parallelism: this rank's experts (a split of the stacked expert weights over ep); under
    sequence parallelism the routers see this tp rank's part of each sequence, under cp its zigzag part."""
    b.routers = bool(moe_modules(b.model))
    b.expert_names = shard_experts(b.model, b.mesh, b.comm, b.placements)
    if b.routers and sequence_parallel and b.mesh.size("tp") > 1:
        b.shards.partial += sequence_parallel_experts(b.model, b.comm)
    if b.routers and b.mesh.size("cp") > 1:
        context_parallel_experts(b.model, b.comm)


def lora(b: Build, settings, check: Callable[[object], None]) -> None:
    """1c. LoRA (`settings`: parallel/lora.py LoraSettings, None when off): the whole model frozen, adapters
    beside the target linears, split as their (already sharded) base layers; `check(spec)` refuses what
    LoRA does not handle. Checkpoints hold the adapters and name the base (LoraBase)."""
    if settings is None:
        return
    check(b.spec)
    b.spec = lora_spec(b.spec, settings)
    add_adapters(b.model, b.placements, b.shards.partial, b.mesh, b.comm, settings)
    b.lora_base = LoraBase(b.spec.hf.source if b.spec.hf is not None else None, settings)


def pipeline(b: Build, split_pipeline: Callable) -> None:
    """2. pipeline: keep this rank's stages (`split_pipeline(model, mesh, comm, adapter)`, pipeline/split.py).
    Names stay global; a weight tied between the first and last stage is held by both, replicated over pp."""
    if b.mesh.size("pp") == 1:
        return
    b.split = split = split_pipeline(b.model, b.mesh, b.comm, b.spec.adapter)
    b.model = split.module
    tied = {id(q) for q in split.tied}
    b.placements = {name: b.placements[split.names[name]].replicated("pp") if id(q) in tied
                    else b.placements[split.names[name]] for name, q in b.model.named_parameters()}


def materialise(b: Build, defer: bool) -> None:
    """2. this rank's shards only, from the pretrained weights or the seeded init. ZeRO-3 fills its units
    one at a time (`defer`: no rank ever holds the whole model) where nothing before it reads the values."""
    if defer:
        b.deferred = defer_parameters(b.model, b.placements, b.mesh.device, b.spec)
    else:
        b.allocated = materialise_model(b.model, b.placements, b.mesh.device, b.spec)


@dataclass(frozen=True)
class Fp8Shape:
    """What the fp8 auto rule reads of the run: tokens per micro-batch, layers, routed experts per token."""

    tokens: int
    layers: int
    top_k: int


def fp8(b: Build, precision: PrecisionConfig, shape: Fp8Shape) -> None:
    """2b. `precision.compute=fp8 | mxfp8`: the blocks' linears get low-precision matmuls (after the tp shards,
    before remat wraps forwards), the auto rule reading this GPU's GEMM ratios; one line on rank 0."""
    if precision.compute not in ("fp8", "mxfp8"):
        return
    from ..planner.compute import fp8_gains
    from ..planner.hardware import fp8_gpu
    from .fp8 import convert_linears, hardware_fp8

    mesh = b.mesh
    gpu = fp8_gpu(torch.cuda.get_device_name(mesh.device)) if hardware_fp8(mesh.device) else None
    gains = None if gpu is None else (lambda m, k, n: fp8_gains(m, k, n, gpu, precision.fp8_recipe))
    names = None if b.split is None else b.split.names

    def global_name(local: str) -> str:  # a module's global name under a pipeline split (by its parameters')
        if names is None:
            return local
        for pname in names:
            if pname.startswith(local + "."):
                return names[pname][: len(names[pname]) - len(pname) + len(local)]
        return local

    report = convert_linears(b.model, precision, b.comm, mesh.device, shape.tokens, shape.layers, global_name, gains,
                             shape.top_k, mesh.size("ep"))
    if mesh.global_rank == 0:
        print(report.line(), file=sys.stderr, flush=True)


def install_tensor_hooks(b: Build) -> None:
    """tp's gradient hooks, once the parameters have storage (under a deferred ZeRO-3 build: after the sync)."""
    if b.deferred is None:
        b.shards.install()


@dataclass(frozen=True)
class ContextOptions:
    """The keys context parallelism and packed rows read."""

    pack: bool  # data.pack
    cp_method: str  # parallel.cp_method
    seq_len: int  # train.seq_len
    preset: str  # model.preset, named in the refusal


def context(b: Build, o: ContextOptions) -> None:
    """2c. context parallelism and packed rows wire the attention seams the family names (`spec.context`): every
    attention gets the other cp ranks' keys and values at the global positions of this rank's zigzag chunks;
    packed rows mask by document. A family with none (or a model in which none is found) is refused under
    the key that asked. Then the family's own hooks (`spec.local_hooks`)."""
    if o.pack or b.mesh.size("cp") > 1:
        key, need, off = (("data.pack", "to mask by document", "data.pack=false") if o.pack else
                          ("parallel.cp", "context parallelism can split", "parallel.cp=1"))
        seams, wired = b.spec.context, False
        if seams is not None and o.pack:
            method = o.cp_method if b.mesh.size("cp") > 1 else "allgather"
            b.documents = install_documents(b.model, seams, b.comm, "cp", method, o.seq_len)
            wired = b.documents is not None
        elif seams is not None:
            wired = install_context(b.model, seams, b.comm, "cp", o.cp_method, o.seq_len)
        if not wired:
            raise ConfigError(key, f"model.preset={o.preset} has no attention {need}; use threefold's own "
                              f"decoder or {off}")
    if b.spec.local_hooks is not None:
        b.spec.local_hooks(b.model)


def remat(b: Build, cfg: RematConfig) -> None:
    """3. activation checkpointing, and the host copies of saved activations around its regions."""
    b.regions = apply_remat(b.model, cfg, b.spec.selective)
    b.activation_offload = apply_offload(b.model, cfg, b.mesh.device)


def precision(b: Build, cfg: PrecisionConfig) -> None:
    """4. mixed precision: compute dtype, fp32 master weights."""
    b.precision = apply_precision(b.model, cfg, b.mesh.device.type)


def replicas(b: Build, zero: int, compress: str, options: SyncOptions, matmul_casts: Callable | None = None,
             replica_axes: tuple[str, ...] | None = None) -> None:
    """5. the gradient sync over dp: the sync kind of `parallel.zero` (parallel/sync_kinds.py), its replicated
    placements naming `replica_axes` (default: every replica axis). A deferred ZeRO-3 build then fills what
    no unit holds (frozen weights outside them) and installs tp's hooks."""
    trainable = [(n, q) for n, q in b.model.named_parameters() if q.requires_grad]
    pipelined = b.split is not None
    s = SyncInput(b.model, b.comm, trainable, b.placements, wire_dtype(zero, compress, b.precision.reduce_dtype),
                  b.precision.compute_dtype, replica_axes or b.mesh.axes_where(REPLICA), options, pipelined,
                  b.deferred, b.units, matmul_casts(b.model) if matmul_casts is not None and zero == 3 else None)
    b.sync = wrap(kind_name(zero, options.periodic is not None), s, b.expert_names)
    b.zero = zero
    if b.deferred is not None:
        b.deferred.rest(b.model)
        b.allocated = b.deferred.bytes
        b.shards.install()


def compile_model(b: Build, enabled: bool | str, backend: str) -> None:
    """6. torch.compile, one region per block and per other top-level module, last: it traces the hooks every
    step above installed inside a region (under a pipeline, the runtime compiles each stage's computation)."""
    apply_compile(b.model, enabled, backend, pipelined=b.split is not None)


def pipeline_runtime(b: Build, compile_stage: Callable | None, compress: str) -> None:
    """The schedule's interpreter, last: it drives the grad sync built above. A lossy dp wire compresses each
    end's buckets with its own residuals: summed before it, the tied copies would take different
    approximations of one gradient and drift apart; summed after it, both ends add the same two sums."""
    if b.split is None:
        return
    b.pipeline = b.split.runtime(b.comm, b.sync.grad_sync, b.precision.compute_dtype, weight_tensors(b),
                                 compile_stage)
    if compress in LOSSY_WIRES:
        b.after_sync = b.pipeline.take_tied_sum()
