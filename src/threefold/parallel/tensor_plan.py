"""Applying a tensor plan (the vocabulary is in models/plans.py): `parallelize_tensor` shards a model over tp.

Splitting in two phases lets `parallelize()` shard a model built on the meta device, keep its
pipeline stages and only then give the local shards storage: `shard_tensor` replaces the
modules and returns the placements plus the gradient hooks still to install on the final
parameters (`TensorShards.install()`); `parallelize_tensor` does both at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm
from ..mesh import Mesh
from ..models.plans import (ColumnParallel, GroupedKV, RowParallel, TensorPlan, TensorPlanError, VocabEmbedding,  # noqa: F401
                     VocabHead, VocabLoss)
from ..sharding import Placement
from .sequence_region import SequenceRegion
from .tensor import (AXIS, ColumnParallelLinear, RowParallelLinear, VocabParallelCrossEntropy, VocabParallelEmbedding,
                     as_parameter, enter_region, padded_size, scatter_sequence, sum_gradient_over)


def _pattern(pattern: str) -> re.Pattern:
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part)
                                       for part in pattern.split(".")) + "$")


def matching_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    rx = _pattern(pattern)
    found = [(name, m) for name, m in model.named_modules() if rx.match(name)]
    if not found:
        raise TensorPlanError(f"tensor plan: pattern '{pattern}' matches no module of {type(model).__name__}")
    return found


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class _Sharder:
    """Cuts parameters into this rank's slices, once per parameter (tied weights stay tied)."""

    def __init__(self, model: nn.Module, tp: int, rank: int):
        self.tp, self.rank = tp, rank
        self.global_name = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        self.done: dict[int, tuple[tuple, nn.Parameter, torch.Tensor]] = {}  # originals kept alive: ids stay unique
        self.placements: dict[int, Placement] = {}  # id(new parameter) -> placement
        self.partial: list[nn.Parameter] = []  # replicated parameters whose gradient is summed over tp

    def sum_over_tp(self, *params: nn.Parameter | None) -> None:
        self.partial += [p for p in params if p is not None and p.requires_grad]

    def split(self, param: torch.Tensor | None, dim: int, pad_to: int | None = None,
              blocks: int = 1) -> nn.Parameter | None:
        """This rank's part of `param` along `dim` (after zero-padding to `pad_to` along it); with
        `blocks` > 1, its part of each of that many equal blocks, concatenated (a fused tensor)."""
        if param is None:
            return None
        key = ("split", dim, pad_to, blocks)
        if id(param) in self.done:
            prev_key, new, _ = self.done[id(param)]
            if prev_key != key:
                raise TensorPlanError(f"tensor plan: tied parameter {self.global_name[id(param)]} is split two ways")
            return new
        data = param.detach()
        if pad_to is not None and pad_to > data.shape[dim]:
            pad_shape = list(data.shape)
            pad_shape[dim] = pad_to - data.shape[dim]
            data = torch.cat([data, data.new_zeros(pad_shape)], dim)
        parts = [block.chunk(self.tp, dim)[self.rank] for block in data.chunk(blocks, dim)]
        # one block needs no cat (on the meta device torch.cat runs a Python decomposition)
        local = (parts[0] if blocks == 1 else torch.cat(parts, dim)).clone()
        new = nn.Parameter(local, requires_grad=param.requires_grad)
        place = Placement.whole(self.global_name[id(param)], param.shape)
        if pad_to is not None:
            place = place.padded(dim, pad_to)
        if blocks > 1:
            place = place.strided(dim, blocks)
        self.placements[id(new)] = place.split(dim, self.rank, self.tp)
        self.done[id(param)] = (key, new, param)
        return new

    def keep(self, param: torch.Tensor | None) -> nn.Parameter | None:
        """`param` whole (replicated over tp)."""
        return as_parameter(param)


def _linear_parts(module: nn.Module, name: str, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    if transposed:  # a Linear stored (in, out), e.g. GPT-2's Conv1D: weight and bias by name
        weight = module.get_parameter("weight")
        return weight, module.bias if "bias" in dict(module.named_parameters(recurse=False)) else None
    if not isinstance(module, nn.Linear):
        raise TensorPlanError(f"tensor plan: {name} is a {type(module).__name__}, not a torch.nn.Linear")
    return module.weight, module.bias


def _check_units(name: str, size: int, unit: int, tp: int, what: str) -> None:
    if size % unit or (size // unit) % tp:
        raise TensorPlanError(f"{name}: {size // unit} {what} cannot be split over parallel.tp={tp}; "
                              f"the count must be divisible by tp (choose a tp that divides {size // unit})")


def _build(style, name: str, module: nn.Module, sharder: _Sharder, comm: Comm, sp: bool, plan: TensorPlan):
    tp, rank = sharder.tp, sharder.rank
    if isinstance(style, ColumnParallel):
        w, b = _linear_parts(module, name, style.transposed)
        out_dim = 1 if style.transposed else 0
        if w.shape[out_dim] % style.fused:
            raise TensorPlanError(f"{name}: {w.shape[out_dim]} output features are not {style.fused} fused equal parts")
        _check_units(name, w.shape[out_dim] // style.fused, style.unit, tp, style.what)
        return ColumnParallelLinear(sharder.split(w, out_dim, blocks=style.fused),
                                    sharder.split(b, 0, blocks=style.fused), comm, transposed=style.transposed)
    if isinstance(style, GroupedKV):
        w, b = _linear_parts(module, name)
        if style.kv_heads % tp == 0:
            return ColumnParallelLinear(sharder.split(w, 0), sharder.split(b, 0), comm)
        if tp % style.kv_heads or style.heads % tp:
            raise TensorPlanError(
                f"{name}: {style.kv_heads} key/value heads cannot be split over parallel.tp={tp} nor replicated "
                f"evenly; kv_heads must divide tp or be divisible by it (and tp must divide heads={style.heads})")
        # fewer kv heads than ranks: every rank keeps the whole (small) weight and uses the kv
        # head its q heads [rank*heads/tp, ...) belong to; partial gradients are summed over tp
        used = rank // (tp // style.kv_heads)
        layer = ColumnParallelLinear(sharder.keep(w), sharder.keep(b), comm,
                                     rows=(used * style.head_dim, style.head_dim))
        sharder.sum_over_tp(layer.weight, layer.bias)
        return layer
    if isinstance(style, RowParallel):
        w, b = _linear_parts(module, name, style.transposed)
        in_dim = 0 if style.transposed else 1
        _check_units(name, w.shape[in_dim], style.unit, tp, style.what)
        layer = RowParallelLinear(sharder.split(w, in_dim), sharder.keep(b), comm, sp, plan.seq_dim, style.transposed)
        if sp:  # the bias meets only this rank's tokens
            sharder.sum_over_tp(layer.bias)
        return layer
    if isinstance(style, VocabEmbedding):
        if not isinstance(module, nn.Embedding):
            raise TensorPlanError(f"tensor plan: {name} is a {type(module).__name__}, not a torch.nn.Embedding")
        padded = padded_size(style.vocab, tp)
        weight = sharder.split(module.weight, 0, pad_to=padded)
        return VocabParallelEmbedding(weight, rank * (padded // tp), style.vocab, comm, sp and style.sequence_output,
                                      module.padding_idx, plan.seq_dim)
    if isinstance(style, VocabHead):
        w, b = _linear_parts(module, name)
        padded = padded_size(style.vocab, tp)
        return ColumnParallelLinear(sharder.split(w, 0, pad_to=padded), sharder.split(b, 0, pad_to=padded), comm,
                                    gather_output=style.gather_output, out_features=style.vocab)
    if isinstance(style, VocabLoss):
        padded = padded_size(style.vocab, tp)
        return VocabParallelCrossEntropy(comm, rank * (padded // tp), style.real or style.vocab)
    raise TensorPlanError(f"tensor plan: unknown style {style!r} for {name}")


def _region_hook(comm: Comm, sp: bool, seq_dim: int, region: SequenceRegion | None = None):
    enter = region.enter if region is not None else (lambda x: enter_region(x, comm, sp, seq_dim))

    def hook(module, args, kwargs):
        if args:
            return (enter(args[0]),) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"])}
        raise TypeError(f"{type(module).__name__}: a tensor-parallel region needs its input as the first "
                        "argument or as hidden_states=")
    return hook


def _scatter_hook(comm: Comm, dim: int):
    return lambda module, args, output: scatter_sequence(output, comm, dim)


def _scatter_input_hook(comm: Comm, dim: int):
    return lambda module, args: (scatter_sequence(args[0], comm, dim),) + tuple(args[1:])


@dataclass
class TensorShards:
    """The result of `shard_tensor`: placements by parameter name and the gradient hooks to install."""

    placements: dict[str, Placement]
    partial: list[nn.Parameter] = field(default_factory=list)  # gradients summed over tp
    comm: Comm | None = None

    def install(self) -> None:
        """Register the tp gradient sums, on the parameters' final storage (after materialisation)."""
        for p in self.partial:
            sum_gradient_over(p, self.comm)
        self.partial = []


def parallelize_tensor(model: nn.Module, mesh: Mesh, comm: Comm, plan: TensorPlan,
                       sequence_parallel: bool = False) -> dict[str, Placement]:
    """Shard `model` in place over the mesh's tp axis by `plan`; return every parameter's Placement.

    Split parameters get `Placement.whole(...)[.padded(...)].split(dim, tp_rank, tp)`; all others
    are whole and `.replicated("tp")`. With tp = 1 nothing changes (and nothing is replicated).
    """
    shards = shard_tensor(model, mesh, comm, plan, sequence_parallel)
    shards.install()
    return shards.placements


def shard_tensor(model: nn.Module, mesh: Mesh, comm: Comm, plan: TensorPlan,
                 sequence_parallel: bool = False) -> TensorShards:
    """`parallelize_tensor` without installing the gradient hooks (works on the meta device)."""
    tp, rank = mesh.size(AXIS), mesh.rank(AXIS)
    if tp == 1:
        return TensorShards({n: Placement.whole(n, p.shape) for n, p in model.named_parameters()}, [], comm)
    if sequence_parallel and not plan.supports_sequence_parallel:
        raise TensorPlanError(f"parallel.sequence_parallel: the tensor plan of {type(model).__name__} does not "
                              "support sequence parallelism; set parallel.sequence_parallel=false")
    sp = sequence_parallel
    sharder = _Sharder(model, tp, rank)
    for pattern, style in plan.layers.items():
        for name, module in matching_modules(model, pattern):
            _set_module(model, name, _build(style, name, module, sharder, comm, sp, plan))
    for pattern in plan.regions:
        for name, module in matching_modules(model, pattern):
            region = SequenceRegion(comm, plan.seq_dim) if sp else None
            module.register_forward_pre_hook(_region_hook(comm, sp, plan.seq_dim, region), with_kwargs=True)
            if region is not None:  # its column-parallel linears save the shard (sequence_region.py SequenceRegion)
                module.register_forward_hook(lambda *_, region=region: region.leave())
                for inner_name, inner in module.named_modules():
                    if isinstance(inner, (ColumnParallelLinear, RowParallelLinear)):
                        inner.region = region
    for pattern in plan.partial + (plan.sequence if sp else ()):
        for _, module in matching_modules(model, pattern):
            sharder.sum_over_tp(*module.parameters(recurse=False))
    if sp:
        for pattern, dim in plan.scatter_sequence.items():
            for _, module in matching_modules(model, pattern):
                module.register_forward_hook(_scatter_hook(comm, dim))
        for pattern, dim in plan.scatter_inputs.items():
            for _, module in matching_modules(model, pattern):
                module.register_forward_pre_hook(_scatter_input_hook(comm, dim))
    for pattern, values in list(plan.attributes.items()) + (list(plan.sequence_attributes.items()) if sp else []):
        for _, module in matching_modules(model, pattern):
            for key, value in values.items():
                setattr(module, key, value)
    _check_ties(model, sharder)
    placements = {}
    for name, p in model.named_parameters():
        placements[name] = sharder.placements.get(id(p)) or Placement.whole(name, p.shape).replicated(AXIS)
    return TensorShards(placements, sharder.partial, comm)


def _check_ties(model: nn.Module, sharder: _Sharder) -> None:
    """Tied modules that the plan both split share one shard (the sharder's memo); a plan that
    split only one of them would silently untie them: refuse."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in sharder.done:
            raise TensorPlanError(f"tensor plan: {name} is tied to a split parameter but is not split itself; "
                                  "give every module sharing the weight the same style")
