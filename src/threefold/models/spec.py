"""The contract between a model family, `parallelize()` and the trainer: one `ModelSpec` object.

A family (models/<family>.py) describes itself completely here; strategies read nothing else:

    build()        the whole single-device module, created on the current default device
                   (`parallelize` calls it under `torch.device("meta")`: no storage yet)
    plan(tp)       its tensor plan (models/plans.py vocabulary)
    adapter        how the pipeline cuts it: embedding / layer list / norm + head + loss
    init(name, shape)  the seeded initial value of one whole tensor, by global name (a shard or a
                   stage initialised alone equals the same part of the whole model)
    tied           {parameter name: name of the parameter it shares storage with}
    local_hooks    called with this rank's module once it has storage: the family's own gradient
                   hooks (GPT-2's frozen key bias inside the fused q/k/v bias), or None
    hf             its Hugging Face form: checkpoint key of every parameter (or how each exported
                   tensor is made from ours), config.json to write, the directory it came from
                   (tokenizer files); None when the family has none
    weights        pretrained values to start from (None: initialised from the seed)
    context        where its attention and learned positions are (`ContextSeams`): what context
                   parallelism and packed documents wire; None: the family has no attention seam

Every family has the same top-level shape, so one pipeline adapter serves all of them:
`embed` (token ids -> x_bsh), `blocks` (a ModuleList of layers x_bsh -> x_bsh), `norm`,
`head` and `loss` (summed token cross-entropy). Nothing here knows about processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from .meta import on_meta
from .plans import TensorPlan
from .loss import head_loss


class PipelineAdapter(Protocol):
    layers: str  # attribute holding the nn.ModuleList cut into stages
    first: tuple[str, ...]  # modules that run before the layers (first stage)
    last: tuple[str, ...]  # modules that run after the layers (last stage)

    def tied(self, model: nn.Module) -> dict[str, str]:
        """{name on the last stage: global name on the first stage} of weights shared by both ends."""

    def embed(self, module: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor: ...

    def head_loss(self, module: nn.Module, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor: ...

    def activation_shape(self, model_cfg, tokens_shape: tuple[int, ...]) -> tuple[int, ...]: ...


class CausalAdapter:
    """embed -> blocks -> norm -> head -> loss: the shape every family in models/ has."""

    layers = "blocks"
    first = ("embed",)
    last = ("norm", "head", "loss")

    def __init__(self, tied: dict[str, str] | None = None, loss_chunk: int = 0):
        self._tied = dict(tied or {})
        self.loss_chunk = loss_chunk  # tokens per piece of the head + loss (models/loss.py); 0: whole

    def tied(self, model: nn.Module) -> dict[str, str]:
        return dict(self._tied)

    def embed(self, module: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor:
        return module.embed(tokens_bs)

    def head_loss(self, module: nn.Module, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """Summed token loss (fp32, 0-dim) of the last stage's output."""
        return head_loss(module.head, module.loss, module.norm(x_bsh), targets_bs, self.loss_chunk)

    def activation_shape(self, model_cfg, tokens_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What flows between stages for a micro-batch of token ids of `tokens_shape`: x_bsh."""
        return (*tokens_shape, model_cfg.hidden)


class WeightSource(Protocol):
    """Pretrained values: fills this rank's local tensors, reading only the boxes they hold."""

    def load(self, named_params: list[tuple[str, nn.Parameter]], placements: dict) -> None: ...


# Buffers that are training state, not constants (their last name): they move every step, so a checkpoint
# holds them and mixed precision leaves them in fp32 (a mixture of experts' bias under
# model.router_balance=bias, models/moe.py)
STATE_BUFFERS = ("expert_bias",)


def is_state_buffer(name: str) -> bool:
    """Whether the buffer of dotted `name` is training state (`STATE_BUFFERS`)."""
    return name.rpartition(".")[2] in STATE_BUFFERS


# In a Hugging Face key (`HFFormat.key_of`), ROW stands for the row index along dimension 0: our
# parameter is the stack of one checkpoint tensor per row (experts stored one by one, e.g.
# Mixtral's `experts.{row}.w1.weight`); loading reads those tensors, exporting writes them.
ROW = "{row}"


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face checkpoint made from parameters of ours (whole, by global name)."""

    key: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None  # None: the one source as it is
    row: int | None = None  # the tensor is row `row` (along dimension 0) of its one source


@dataclass(frozen=True)
class HFFormat:
    """How a family's parameters are named in a Hugging Face checkpoint (renames of name prefixes),
    and, for a family whose tensors differ from the library's (the reference decoder), how each
    exported tensor is made from ours (`exports`)."""

    renames: tuple[tuple[str, str], ...]  # (regex on our name, replacement giving the HF key)
    config: dict = field(default_factory=dict)  # the config.json of the model
    source: Path | None = None  # the directory the model came from (tokenizer files), if any
    exports: Callable[[list[str]], list[HFTensor]] | None = None  # our names -> the tensors to write

    def key_of(self, name: str) -> str:
        for pattern, replacement in self.renames:
            key, n = re.subn(pattern, replacement, name)
            if n:
                return key
        return name

    def tensors(self, names: list[str]) -> list[HFTensor]:
        """The Hugging Face tensors to write for the parameters `names` (global, without model/)."""
        if self.exports is not None:
            return self.exports(names)
        return [HFTensor(self.key_of(n), (n,)) for n in names]


@dataclass(frozen=True)
class ContextSeams:
    """A family's seams for context parallelism and packed documents (parallel/context.py wires them):
    `attention`, its module classes whose attention a core may compute (each has an `attention_core`:
    None, or the core); `positions`, its embeddings with learned positions (each has `positions`: None,
    or the positions of the local tokens). Rotary families have none of the second kind: their blocks
    take the positions from the core."""

    attention: tuple[type[nn.Module], ...]
    positions: tuple[type[nn.Module], ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    family: str
    build: Callable[[], nn.Module]
    plan: Callable[[int], TensorPlan]
    adapter: PipelineAdapter
    init: Callable[[str, tuple[int, ...]], torch.Tensor]
    tied: dict[str, str] = field(default_factory=dict)
    local_hooks: Callable[[nn.Module], None] | None = None
    hf: HFFormat | None = None
    weights: WeightSource | None = None
    context: ContextSeams | None = None  # None: no attention seam (context parallelism and packing refused)
    # the parts of every block that `remat.policy=selective` recomputes unless remat.targets names others:
    # the family's own module names (submodules or methods, relative to blocks.<i>)
    selective: tuple[str, ...] = ("attn.core",)
    # a user's own module (`py:MODULE:FACTORY`, models/py_module.py): (module, micro-batch) -> its summed
    # token loss. `parallelize` then takes the module path (parallel/module.py: no plan, no pipeline) and
    # `build` is called on the real device, `init` unused (the factory's values, broadcast from rank 0)
    module_loss: Callable[[nn.Module, object], torch.Tensor] | None = None


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Normal(0, std) values that depend only on (seed, name)."""
    from .decoder import parameter_seed

    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def empty_whole(spec: ModelSpec, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model on `device` with storage but no parameter values (tied parameters not yet retied)."""
    with on_meta():
        model = spec.build()
    # buffers a family builds with an explicit device (a Hugging Face model's rotary tables) keep their values
    kept = {name: b.clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)
    return model


def build_whole(spec: ModelSpec, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model on `device` with its initial (seeded) values: for references and tests."""
    model = empty_whole(spec, device)
    with torch.no_grad():
        seen = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen[id(p)] = name
            p.copy_(spec.init(name, tuple(p.shape)))
    retie(model, spec.tied)
    return model


def retie(model: nn.Module, tied: dict[str, str]) -> None:
    """Make the parameters named in `tied` share storage again (after `to_empty`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, other in tied.items():
        if name in params and other in params:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, params[other])
