"""The pipeline split: this rank's stages of the model, the schedule, the runtime's inputs.

`split_pipeline` is step 2 of `parallelize()`: it keeps this rank's stages of the model and
prepares the schedule; `PipelineSplit.runtime` then builds the interpreter once the gradient
sync over dp exists. See docs/pipeline.md.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from ..config import Config
from ..mesh import PAIR, Mesh
from ..observe.memory import SavedTensorMeter
from .adapter import DecoderAdapter, MTPAdapter, PipelineAdapter
from .runtime import ModuleCompute, PipelineRuntime
from ..schedules.registry import Schedule, build_schedule, kind, pair_overlap_blockers, paired_schedule
from ..config.checks import parse_split
from .stage import (RankModule, Stage, balance, global_names, materialise, measured_costs, parameter_costs,
                    stages_from_bounds)

__all__ = ["PipelineSplit", "split_pipeline", "plan_stages", "build_schedule", "PipelineRuntime"]


@dataclass
class PipelineSplit:
    module: RankModule  # this rank's stages, parameters under global names
    stages: list[Stage]  # this rank's stages, in chunk order
    all_stages: list[Stage]
    schedule: Schedule
    adapter: PipelineAdapter
    names: dict[str, str]  # local parameter name -> global name
    tied: list[nn.Parameter]  # weights this rank shares with the other end of the pipeline
    tied_peer: int  # pp coordinate holding the other copy
    model_cfg: object
    seq_shards: int = 1  # sequence parallelism: each tp rank holds 1/tp of the sequence between stages
    overlap_pairs: bool = False  # run the schedule's (F, B) pairs at once (`overlaps_pairs`)

    def runtime(self, comm: Comm, grad_sync, dtype: torch.dtype = torch.float32,
                weights: list[torch.Tensor] | None = None, compile_stage=None) -> PipelineRuntime:
        """The interpreter for this rank. `weights`: every tensor holding weights (under ZeRO-3 the
        shards and the whole forms), which the activation meter must not count. `compile_stage`:
        what turns a stage's computation into its compiled form (`train.compile`), or None."""
        own = kind(self.schedule.name).runtime  # a schedule with its own runtime (pipedream-2bw: two_bw.py)
        if own is not None:
            return pkgutil.resolve_name(own)(self, comm, grad_sync, dtype, weights, compile_stage)
        if weights is None:
            weights = list(self.module.parameters()) + list(self.module.buffers())
        meter = SavedTensorMeter(exclude=weights)
        compute = ModuleCompute(self.module, self.adapter, grad_sync, meter, compile_stage)
        # the tied weights' gradients as the sync holds them after the schedule: whole and not yet
        # reduced over dp (plain DP, ZeRO 1-2), or this rank's reduced shard (ZeRO-3); both ends alike
        gradient_of = grad_sync.gradient_of if grad_sync is not None else (lambda p: p.grad)
        tied_grads = (lambda: sum_tied_gradients(comm, [_grad_or_zeros(p, gradient_of) for p in self.tied],
                                                 self.tied_peer)) if self.tied else None
        schedule, pairs = self.schedule, frozenset()
        if self.overlap_pairs and compile_stage is None:
            schedule, together = paired_schedule(self.schedule)
            pairs = together[comm.mesh.rank("pp")]
        return PipelineRuntime(schedule, self.stages, compute, comm, self.activation_shape, dtype, tied_grads,
                               pairs)

    def activation_shape(self, tokens_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What crosses stages for a micro-batch of `tokens_shape` (batch, sequence) token ids: under
        sequence parallelism this rank's share of the sequence, as the blocks leave it."""
        batch, seq, *rest = tokens_shape
        return self.adapter.activation_shape(self.model_cfg, (batch, seq // self.seq_shards, *rest))


def overlaps_pairs(cfg: Config, mesh: Mesh) -> bool:
    """Whether the runtime runs the schedule's overlapped (F, B) pairs at once, each side's expert
    all-to-alls on its own ep group (runtime.py): a schedule with pairs (dualpipev), ep > 1, and
    no other collective inside a stage or process-wide state two threads would share - tp = 1,
    ZeRO below 3, no activation checkpointing, no compiled stages."""
    return (kind(cfg.pipeline.schedule).pairs is not None and mesh.size("ep") > 1
            and not pair_overlap_blockers(mesh.size("tp"), cfg.parallel.zero, cfg.remat.policy, cfg.train.compile is True))


def plan_stages(model: nn.Module, adapter: PipelineAdapter, cfg: Config, num_stages: int,
                mesh: Mesh | None = None, comm: Comm | None = None) -> list[Stage]:
    """All stages of the model: explicit `pipeline.split`, or balanced by parameters or time."""
    num_layers = len(getattr(model, adapter.layers))
    if cfg.pipeline.split:
        bounds = parse_split(cfg.pipeline.split, num_layers, num_stages)
    elif cfg.pipeline.balance == "time":
        t = cfg.train
        micro = t.global_batch // (cfg.parallel.dp or 1) // t.microbatches
        device = mesh.device if mesh is not None else torch.device("cpu")
        layer_costs, first, last = measured_costs(model, adapter, cfg.model, (micro, t.seq_len), device)
        if comm is not None:  # ranks time differently: all adopt global rank 0's figures
            figures = torch.tensor(layer_costs + [first, last], dtype=torch.float64, device=device)
            for axis in reversed(comm.mesh.axis_names):
                comm.broadcast(figures, axis, src=0)
            *layer_costs, first, last = figures.tolist()
        bounds = balance(layer_costs, num_stages, first, last)
    else:
        layer_costs, first, last = parameter_costs(model, adapter)
        bounds = balance(layer_costs, num_stages, first, last)
    return stages_from_bounds(bounds, num_layers)


def split_pipeline(model: nn.Module, mesh: Mesh, comm: Comm, cfg: Config, init=None,
                   adapter: PipelineAdapter | None = None) -> PipelineSplit:
    """Keep this rank's stages of `model` (built on any device, meta included).

    `adapter`: the model's (`ModelSpec.adapter`); the reference decoder's when not given.
    `init(named)` initialises parameters by global name when the model lives on the meta
    device (only this rank's stages are then allocated); `parallelize` materialises instead.
    """
    adapter = adapter or DecoderAdapter()
    if cfg.model.mtp_depth:  # the depths and a copy of the embedding on the last stage (adapter.py)
        adapter = MTPAdapter(adapter, cfg.model.mtp_weight, cfg.model.loss_chunk)
    p, v = mesh.size("pp"), cfg.pipeline.virtual_stages
    schedule = build_schedule(cfg.pipeline.schedule, p, cfg.train.microbatches, v)
    all_stages = plan_stages(model, adapter, cfg, schedule.num_stages, mesh, comm)
    rank = mesh.rank("pp")
    mine = [all_stages[s] for s in schedule.stages_of(rank)]  # the schedule's placement, in chunk order
    tied_map = adapter.tied(model)
    module = RankModule(model, adapter, mine)
    if init is not None:
        materialise(module, mesh.device, tied_map, init)
    names = global_names(module, tied_map)
    holds_first, holds_last = any(s.first for s in mine), any(s.last for s in mine)
    tied, peer = [], 0
    shared = adapter.shared(model) if isinstance(adapter, MTPAdapter) else []
    if (tied_map or shared) and holds_first != holds_last:  # under the V placement rank 0 holds both ends
        tied = shared_weights(module, names, [*tied_map.values(), *shared])
        peer = schedule.stage_rank(all_stages[-1].index) if holds_first else schedule.stage_rank(0)
    seq_shards = mesh.size("tp") if cfg.parallel.sequence_parallel else 1
    overlap = overlaps_pairs(cfg, mesh)
    if overlap:  # collective: every rank splits the pipeline at the same point
        mesh.add_lane("ep", PAIR)
    return PipelineSplit(module, mine, all_stages, schedule, adapter, names, tied, peer, cfg.model, seq_shards,
                         overlap)


def shared_weights(module: RankModule, names: dict[str, str], wanted: list[str]) -> list[nn.Parameter]:
    """This end's trainable copies of the weights of global names `wanted` (a tied head stands for its
    embedding), once each and in the order of their global names: both ends list them alike."""
    local = {names[n]: q for n, q in module.named_parameters() if q.requires_grad}
    return [local[n] for n in sorted(set(wanted)) if n in local]


def _grad_or_zeros(param: nn.Parameter, gradient_of) -> torch.Tensor:
    grad = gradient_of(param)
    if grad is None:  # no gradient reached this end (plain tensors without a sync)
        grad = param.grad = torch.zeros_like(param)
    return grad


def sum_tied_gradients(comm: Comm, grads: list[torch.Tensor], peer: int) -> None:
    """First and last stage each add the other's gradient of their shared weights (send/recv on "pp").

    `grads` are the tensors holding the gradients, in the same form on both ends. Both end with
    the same sum (a + b == b + a exactly), so both copies take the same step.
    """
    for grad in grads:
        received = torch.empty_like(grad)
        for handle in comm.batch_send_recv([(grad, "pp", peer)], [(received, "pp", peer)]):
            handle.wait()
        grad.add_(received)
