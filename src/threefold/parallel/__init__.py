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

Each step is a function of its own sub-config and the mesh; none imports another strategy.
Step 5 also decides which part of every parameter this rank's optimizer updates (`pieces`):
whole parameters for plain DP, this rank's shards under ZeRO; `make_optimizer` builds the
fp32-master optimizer over them (AdamW or momentum SGD, parallel/master.py), in a host pool
with `parallel.offload`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ..comm import Comm
from ..comm.quantize import fp8_supported
from ..config import Config
from ..errors import ConfigError
from ..mesh import REPLICA, Mesh
from ..models.moe import moe_modules
from ..models.spec import ModelSpec
from .comm_hook import make_comm_hook
from .compile import apply_compile, stage_compiler
from .data import DataParallelReducer, parallelize_data
from .expert import ExpertParallelSync, context_parallel_experts, sequence_parallel_experts, shard_experts
from .hpz import NO_HPZ, secondary_partition
from .local_sgd import periodic_hook, periodic_sync
from .lora import LoraBase, add_adapters, check_supported, lora_settings, lora_spec
from .master import Piece
from .materialise import Deferred, defer_parameters, materialise
from .nvme import ScratchSettings, ShardStore, return_freed_memory
from .model import GradSync, ParallelModel, accumulate
from .context import PackedDocuments, install_context, install_documents
from .module import parallelize_module
from .precision import apply_precision
from .remat import apply_offload, apply_remat
from .tensor_plan import shard_tensor
from .zero import ZeroReducer
from .zero3 import Zero3

__all__ = ["GradSync", "ParallelModel", "accumulate", "parallelize", "parallelize_module"]


def parallelize(spec: ModelSpec, mesh: Mesh, comm: Comm, cfg: Config) -> ParallelModel:
    if spec.module_loss is not None:  # a user's own module (py:MODULE:FACTORY): no plan (parallel/module.py)
        if mesh.size("cp") > 1:  # no attention seam to split (config/checks.py refuses it first)
            raise ConfigError("parallel.cp", f"model.preset={cfg.model.preset}: a module of your own has no attention "
                              "context parallelism can split; use parallel.cp=1")
        torch.manual_seed(cfg.train.seed)  # the factory's init, the same on every rank (and broadcast from dp 0)
        return parallelize_module(spec.build(), mesh, comm, cfg, spec.module_loss)
    if cfg.parallel.offload == "nvme" and cfg.parallel.offload_return_memory:  # freed host buffers back to the system
        return_freed_memory()
    # 0. the whole model, without storage
    with torch.device("meta"):
        model = spec.build()
    # 1. tensor parallelism (placements keyed by global parameter names; gradient hooks installed
    # once the parameters have storage)
    shards = shard_tensor(model, mesh, comm, spec.plan(mesh.size("tp")), cfg.parallel.sequence_parallel)
    placements = shards.placements
    # 1b. expert parallelism: this rank's experts (a split of the stacked expert weights over ep);
    # under sequence parallelism the routers see this tp rank's part of each sequence
    routers = bool(moe_modules(model))
    expert_names = shard_experts(model, mesh, comm, placements)
    if routers and cfg.parallel.sequence_parallel and mesh.size("tp") > 1:
        shards.partial += sequence_parallel_experts(model, comm)
    if routers and mesh.size("cp") > 1:  # the routers see this cp rank's zigzag part of each sequence
        context_parallel_experts(model, comm)
    # 1c. LoRA: the whole model frozen, adapters beside the target linears, split as their (already sharded)
    # base layers; their initial values come from the seeded LoRA init (parallel/lora.py)
    lora = lora_settings(cfg.model, cfg.train.seed)
    if lora is not None:
        check_supported(spec, cfg)
        spec = lora_spec(spec, lora)
        add_adapters(model, placements, shards.partial, mesh, comm, lora)
    # 2. pipeline: keep this rank's stages. Names stay global; a weight tied between the first and
    # last stage is held by both, replicated over pp (counted once, at pp coordinate 0).
    split = None
    if mesh.size("pp") > 1:
        from ..pipeline import split_pipeline

        split = split_pipeline(model, mesh, comm, cfg, adapter=spec.adapter)
        model = split.module
        tied = {id(q) for q in split.tied}
        placements = {name: placements[split.names[name]].replicated("pp") if id(q) in tied
                      else placements[split.names[name]] for name, q in model.named_parameters()}
    # ZeRO-3 fills its units one at a time (no rank ever holds the whole model) where nothing before it reads
    # the values: no fp8 conversion, no family hooks
    deferred = defer_parameters(model, placements, mesh.device, spec) if _defers(cfg, spec) else None
    allocated = 0 if deferred is not None else materialise(model, placements, mesh.device, spec)
    # 2b. fp8: the blocks' linears get float8 matmuls (after the tp shards, before remat wraps forwards)
    _convert_fp8(model, cfg, comm, mesh, None if split is None else split.names)
    if deferred is None:  # else once ZeRO-3 has given the parameters storage (a meta tensor keeps no hooks)
        shards.install()
    # 2b. context parallelism: every attention gets the other cp ranks' keys and values, the positions
    # are the global ones of this rank's zigzag chunks (the trainer's step splits the micro-batches)
    # packed rows (data.pack): one core masking by document, handed each micro-batch's ids and positions
    # by the step (at cp = 1 over an axis of one rank: it sends nothing)
    documents = None
    if cfg.data.pack or mesh.size("cp") > 1:
        documents = _wire_context(model, spec, comm, cfg, mesh)
    if spec.local_hooks is not None:
        spec.local_hooks(model)
    # 3. activation checkpointing
    regions = apply_remat(model, cfg.remat, spec.selective)
    activation_offload = apply_offload(model, cfg.remat, mesh.device)  # around the regions: after them
    # 4. mixed precision
    precision = apply_precision(model, cfg.precision, mesh.device.type)
    # 5. gradient sync over dp
    grad_sync, placements, pieces, after_step, periodic = _sync_over_dp(model, placements, comm, mesh, cfg, precision,
                                                                        split is not None, expert_names, deferred)
    if deferred is not None:  # what no ZeRO-3 holds (frozen weights outside its units), filled whole
        deferred.rest(model)
        allocated = deferred.bytes
        shards.install()
    # 6. torch.compile, one region per block and per other top-level module, last: it traces the hooks
    # every step above installed inside a region (under a pipeline, each stage's computation: the
    # runtime below compiles it)
    apply_compile(model, cfg.train.compile, cfg.debug.compile_backend, pipelined=split is not None)
    p = cfg.parallel
    scratch = scratch_settings(cfg, mesh) if p.offload == "nvme" else None
    parallel = ParallelModel(model, grad_sync, placements, pieces, precision, p.zero, p.offload != "none",
                             after_step, regions, spec=spec, materialised_bytes=allocated, periodic=periodic,
                             routers=routers, activation_offload=activation_offload,
                             scratch=scratch, replica_axis=mesh.replica_axis, documents=documents, comm=comm)
    if lora is not None:  # checkpoints hold the adapters and name the base (parallel/lora.py LoraBase)
        parallel.lora_base = LoraBase(spec.hf.source if spec.hf is not None else None, lora)
    if isinstance(grad_sync, ZeroReducer):  # parameter gathers may be in flight after a step
        parallel.settle_weights = grad_sync.settle
    if isinstance(grad_sync, Zero3) and grad_sync.home is not None:  # the shards in memory for a reader
        parallel.shard_home = grad_sync.home
        parallel.grad_home = grad_sync.grad_home
    if split is not None:  # the schedule's interpreter, last: it drives the grad sync built above
        parallel.pipeline = split.runtime(comm, grad_sync, precision.compute_dtype, parallel.weight_tensors(),
                                          stage_compiler(cfg.train.compile, cfg.debug.compile_backend))
        if cfg.compress.method in LOSSY_WIRES:
            # a lossy dp wire compresses each end's buckets with its own residuals: summed before it,
            # the tied copies would take different approximations of one gradient and drift apart.
            # Summed after it, both ends add the same two decompressed sums.
            parallel.after_sync = parallel.pipeline.take_tied_sum()
    return parallel


def _wire_context(model: nn.Module, spec: ModelSpec, comm: Comm, cfg: Config, mesh: Mesh) -> PackedDocuments | None:
    """Context parallelism and packed rows wire the attention seams the family names (`spec.context`); a
    family with none (or a model in which none is found) is refused under the key that asked."""
    key, need, off = (("data.pack", "to mask by document", "data.pack=false") if cfg.data.pack else
                      ("parallel.cp", "context parallelism can split", "parallel.cp=1"))
    documents, wired = None, 0
    if spec.context is not None and cfg.data.pack:
        method = cfg.parallel.cp_method if mesh.size("cp") > 1 else "allgather"
        documents = install_documents(model, spec.context, comm, "cp", method, cfg.train.seq_len)
        wired = documents is not None
    elif spec.context is not None:
        wired = install_context(model, spec.context, comm, "cp", cfg.parallel.cp_method, cfg.train.seq_len)
    if not wired:
        raise ConfigError(key, f"model.preset={cfg.model.preset} has no attention {need}; use threefold's own "
                          f"decoder or {off}")
    return documents


def _defers(cfg: Config, spec: ModelSpec) -> bool:
    """Whether ZeRO-3 builds the parameters unit by unit (`materialise.Deferred`)."""
    return cfg.parallel.zero == 3 and cfg.precision.compute not in ("fp8", "mxfp8") and spec.local_hooks is None


def scratch_settings(cfg: Config, mesh: Mesh) -> ScratchSettings:
    p = cfg.parallel
    return ScratchSettings(Path(p.offload_dir), p.offload_prefetch, p.offload_block_mb, mesh.global_rank)


LOSSY_WIRES = ("dgc", "onebit", "powersgd")  # dp gradient exchanges that are not an exact sum


def _expert_sync(model: nn.Module, named, expert_names: set[str], placements, comm: Comm, cfg: Config, wire,
                 pipelined: bool, deferred: Deferred | None):
    """Step 5 with ep > 1: dense parameters over dp (dp+cp under cp), experts over edp (edp+cp under cp:
    they are replicated over cp too), each plain or ZeRO-1/2/3."""
    stage, p = cfg.parallel.zero, cfg.parallel
    dense = [(n, q) for n, q in named if n not in expert_names]
    experts = [(n, q) for n, q in named if n in expert_names]
    replicas, expert_axis = comm.mesh.axes_where(REPLICA), comm.mesh.expert_replica_axis
    replicated = {name: place.replicated(*(comm.mesh.expert_replica_axes if name in expert_names else replicas))
                  for name, place in placements.items()}
    if stage == 3:  # dense parameters sharded over dp (+cp), experts over edp (+cp): two ZeRO-3s on the one model
        zero3 = {"wire_dtype": wire, "stage_passes": pipelined, "weight_comm": p.zero_weight_comm,
                 "grad_comm": p.zero_grad_comm, "deferred": deferred}
        syncs = (Zero3(model, comm, **zero3, only={id(q) for _, q in dense}, matmul_casts=_matmul_casts(model, cfg)),
                 Zero3(model, comm, axis=expert_axis, **zero3, only={id(q) for _, q in experts}))
        pieces = syncs[0].pieces(placements) + syncs[1].pieces(placements)
        return (ExpertParallelSync(*syncs, [q for _, q in experts]),
                syncs[1].placements(syncs[0].placements(placements)), pieces, None)
    if stage == 0:
        syncs = (DataParallelReducer([q for _, q in dense], comm, p.bucket_mb),
                 DataParallelReducer([q for _, q in experts], comm, p.bucket_mb, axis=expert_axis))
        return ExpertParallelSync(*syncs, [q for _, q in experts]), replicated, _whole_pieces(named, replicated), None
    # ZeRO-1/2: optimizer states sharded over dp (dense) and edp (experts), each with cp; the expert sync
    # reduces in finish()
    syncs = (ZeroReducer(dense, comm, stage, p.bucket_mb, wire, defer=pipelined),
             ZeroReducer(experts, comm, stage, p.bucket_mb, wire, axis=expert_axis, defer=True))
    pieces = syncs[0].pieces(placements) + syncs[1].pieces(placements)

    def after_step():
        syncs[0].gather_params()
        syncs[1].gather_params()
    return ExpertParallelSync(*syncs, [q for _, q in experts]), replicated, pieces, after_step


def _matmul_casts(model: nn.Module, cfg: Config) -> dict:
    """fp8 compute with ZeRO-3's fp8 gather: the weights the gather sends as their matmul's fp8 (zero3.py)."""
    if cfg.precision.compute != "fp8" or cfg.parallel.zero_weight_comm != "fp8":
        return {}
    from .fp8 import cast_weight_kernels
    return cast_weight_kernels(model)


def _convert_fp8(model: nn.Module, cfg: Config, comm: Comm, mesh: Mesh, names: dict[str, str] | None) -> None:
    """`precision.compute=fp8`: convert the blocks' linears (parallel/fp8.py), the auto rule reading this
    GPU's fp8/bf16 GEMM ratios (planner/compute.py); one line on rank 0 says how many converted and why."""
    if cfg.precision.compute not in ("fp8", "mxfp8"):
        return
    from ..planner.compute import fp8_gains
    from ..planner.hardware import fp8_gpu
    from .fp8 import convert_linears, hardware_fp8

    t = cfg.train
    tokens = max(1, t.global_batch // (mesh.size("dp") * t.microbatches)) * t.seq_len
    gpu = fp8_gpu(torch.cuda.get_device_name(mesh.device)) if hardware_fp8(mesh.device) else None
    gains = None if gpu is None else (lambda m, k, n: fp8_gains(m, k, n, gpu, cfg.precision.fp8_recipe))

    def global_name(local: str) -> str:  # a module's global name under a pipeline split (by its parameters')
        if names is None:
            return local
        for pname in names:
            if pname.startswith(local + "."):
                return names[pname][: len(names[pname]) - len(pname) + len(local)]
        return local

    report = convert_linears(model, cfg.precision, comm, mesh.device, tokens, cfg.model.layers, global_name, gains,
                             max(1, cfg.model.experts_top_k), mesh.size("ep"))
    if mesh.global_rank == 0:
        print(report.line(), file=sys.stderr, flush=True)


def _sync_over_dp(model: nn.Module, placements, comm: Comm, mesh: Mesh, cfg: Config, precision, pipelined: bool,
                  expert_names: set[str] = frozenset(), deferred: Deferred | None = None):
    """Step 5: plain data parallelism (or its periodic form) or ZeRO 1-3
    -> (grad sync, placements, optimizer pieces, after_step, periodic sync).
    Expert parameters spread over ep (`expert_names`) are summed over edp only (edp and cp under cp)."""
    stage, p = cfg.parallel.zero, cfg.parallel
    wire = precision.reduce_dtype
    if stage >= 1 and cfg.compress.method in ("fp16", "bf16"):  # ZeRO's only compression: a 16-bit wire
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.compress.method]
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    if stage == 3 and p.zero_weight_comm == "fp8" and not fp8_supported(mesh.device):
        raise ConfigError("parallel.zero_weight_comm", f"this torch cannot cast to float8_e4m3fn on {mesh.device}; "
                          "use parallel.zero_weight_comm=int8")
    if expert_names:
        return (*_expert_sync(model, named, expert_names, placements, comm, cfg, wire, pipelined, deferred), None)
    periodic = None
    if stage == 0:
        hook_wire = wire if wire != precision.compute_dtype else None
        hook = make_comm_hook(cfg, mesh.size(mesh.replica_axis), hook_wire)
        if cfg.train.periodic:  # between syncs, gradients are summed inside a replica only
            hook = periodic_hook(hook, comm, hook_wire)
        grad_sync = parallelize_data(model, comm, p.bucket_mb, hook)
        # local SGD / DiLoCo / EASGD: the replicas meet every train.sync_every steps, bucket by bucket
        periodic = (periodic_sync(comm, cfg.train, hook, grad_sync.buckets.buckets, [q for _, q in named])
                    if cfg.train.periodic else None)
        placements = {name: place.replicated(*mesh.axes_where(REPLICA)) for name, place in placements.items()}
        return grad_sync, placements, _whole_pieces(named, placements), None, periodic
    if stage in (1, 2):
        # with a pipeline, stage 2 reduce-scatters after the last micro-batch (see zero.py)
        grad_sync = ZeroReducer(named, comm, stage, p.bucket_mb, wire, defer=pipelined)
        pieces = grad_sync.pieces(placements)  # optimizer states: sharded over dp
        placements = {name: place.replicated(*mesh.axes_where(REPLICA)) for name, place in placements.items()}
        if pipelined:  # the schedule runs stage modules out of order: the gather is waited for after the step
            return grad_sync, placements, pieces, grad_sync.gather_params, None
        grad_sync.overlap_gather(model)  # the next forward waits for each segment it needs (zero.py)
        return grad_sync, placements, pieces, grad_sync.defer_param_gather, None
    # with a pipeline, each schedule pass reduces only the units it reached (see zero3.py)
    home = ShardStore(scratch_settings(cfg, mesh)) if p.offload == "nvme" else None  # the shards in scratch too
    # and the reduced gradients, streamed by the step (a pipeline's passes keep theirs in memory)
    grad_home = ShardStore(scratch_settings(cfg, mesh), "grads") if home is not None and not pipelined else None
    grad_sync = Zero3(model, comm, wire, stage_passes=pipelined, weight_comm=p.zero_weight_comm,
                      grad_comm=p.zero_grad_comm, hpz=secondary_partition(comm, pipelined) if p.zero_hpz else NO_HPZ,
                      home=home, matmul_casts=_matmul_casts(model, cfg), deferred=deferred, grad_home=grad_home)
    pieces = grad_sync.pieces(placements)
    return grad_sync, grad_sync.placements(placements), pieces, None, None


def _whole_pieces(named, placements) -> list[Piece]:
    """Without ZeRO the optimizer updates every parameter whole: one piece per parameter."""
    return [Piece(name, placements[name], q.detach().view(-1), (lambda q=q: q.grad.view(-1)), q.dim() >= 2)
            for name, q in named]
