"""Cut a model into pipeline stages and keep this rank's stages, with their global names.

The layer list of the model (see adapter.py) is cut into S = pp * v contiguous stages:

* at explicit boundaries (`pipeline.split`: the first layer of every stage after the first),
* or balanced: the cut that minimises the largest stage cost, where a layer costs its
  parameter count (`balance = "params"`) or its measured forward + backward time
  (`balance = "time"`); the embedding counts on the first stage, norm + head on the last.

Stage s runs on the pp rank its schedule's placement names (actions.stage_rank): s % pp
(Megatron's interleaved layout, so v > 1 gives each rank v chunks spread along the model), or
the V of zb-v and dualpipev (rank r holds stages r and 2 pp - 1 - r). A rank keeps one module,
`RankModule`, that holds exactly its stages' parameters under their global names
(`blocks.7.attn.q.weight`), so initialisation by name, placements, checkpoints and the gradient
norm need no translation. A weight shared by
the two ends (a tied embedding / head) lives on both the first and the last stage.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .adapter import PipelineAdapter


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range  # indices into the model's layer list
    first: bool  # runs the modules before the layers (embedding)
    last: bool  # runs the modules after the layers (norm, head, loss)


def stages_from_bounds(bounds: list[int], num_layers: int) -> list[Stage]:
    """`bounds` = first layer of each stage (bounds[0] == 0)."""
    ends = list(bounds[1:]) + [num_layers]
    n = len(bounds)
    return [Stage(i, range(b, e), i == 0, i == n - 1) for i, (b, e) in enumerate(zip(bounds, ends))]


def balance(layer_costs: list[float], num_stages: int, first_extra: float = 0.0,
            last_extra: float = 0.0) -> list[int]:
    """Stage bounds minimising the largest stage cost (contiguous, at least one layer each).

    Dynamic programme over (stage, first layer of the next stage); ties keep earlier cuts
    later, so equal layers split evenly. O(S L^2): instant for any real model.
    """
    L, S = len(layer_costs), num_stages
    if S > L:
        raise ConfigError("parallel.pp", f"{S} pipeline stages but only {L} layers; use at most {L} stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, a: int, b: int) -> float:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0.0) + (last_extra if stage == S - 1 else 0.0)

    inf = float("inf")
    # best[k][i]: smallest max cost of stages 0..k covering layers [0, i)
    best = [[inf] * (L + 1) for _ in range(S)]
    cut = [[0] * (L + 1) for _ in range(S)]
    for i in range(1, L + 1):
        best[0][i] = cost(0, 0, i)
    for k in range(1, S):
        for i in range(k + 1, L + 1):
            for j in range(k, i):
                value = max(best[k - 1][j], cost(k, j, i))
                if value < best[k][i] or (value == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], L
    for k in range(S - 1, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return [0] + bounds[::-1]


def parameter_costs(model: nn.Module, adapter: PipelineAdapter) -> tuple[list[float], float, float]:
    """(per-layer parameter counts, first-stage extra, last-stage extra); a tied head counts as compute."""
    layers = getattr(model, adapter.layers)

    def count(module: nn.Module) -> float:
        return float(sum(p.numel() for _, p in module.named_parameters(remove_duplicate=False)))

    return ([count(layer) for layer in layers], sum(count(getattr(model, n)) for n in adapter.first),
            sum(count(getattr(model, n)) for n in adapter.last))


def measured_costs(model: nn.Module, adapter: PipelineAdapter, model_cfg, tokens_shape: tuple[int, ...],
                   device: torch.device, repeats: int = 3) -> tuple[list[float], float, float]:
    """(per-layer seconds, embedding seconds, head + loss seconds) of forward + backward.

    Each part is copied to `device` with fresh random weights (so a model on the meta device
    can be measured too) and timed `repeats` times after a warm-up; the median counts.
    Timings differ between ranks: the caller must make every rank use the same numbers.
    """
    x_shape = adapter.activation_shape(model_cfg, tokens_shape)
    vocab = model_cfg.vocab
    tokens = torch.randint(0, vocab, tokens_shape, device=device)

    def probe(names: list[str]) -> SimpleNamespace:
        parts = {n: copy.deepcopy(getattr(model, n)).to_empty(device=device) for n in names}
        with torch.no_grad():
            for part in parts.values():
                for p in part.parameters():
                    p.normal_(0.0, 0.02)
        return SimpleNamespace(**parts)

    def timed(run: Callable[[], torch.Tensor]) -> float:
        samples = []
        for _ in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run().float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        return sorted(samples[1:])[len(samples[1:]) // 2]

    layer_costs = []
    for layer in getattr(model, adapter.layers):
        block = copy.deepcopy(layer).to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        x = torch.randn(x_shape, device=device, requires_grad=True)
        layer_costs.append(timed(lambda: block(x)))
    first = probe(list(adapter.first))
    last = probe(list(adapter.last))
    x = torch.randn(x_shape, device=device, requires_grad=True)
    return (layer_costs, timed(lambda: adapter.embed(first, tokens)),
            timed(lambda: adapter.head_loss(last, x, tokens)))


class RankModule(nn.Module):
    """This rank's stages: the model's modules they use, registered under their global names."""

    def __init__(self, model: nn.Module, adapter: PipelineAdapter, stages: list[Stage]):
        super().__init__()
        self.stages = stages
        if any(s.first for s in stages):
            for name in adapter.first:
                setattr(self, name, getattr(model, name))
        layers = getattr(model, adapter.layers)
        setattr(self, adapter.layers, nn.ModuleDict({str(i): layers[i] for s in stages for i in s.layers}))
        if any(s.last for s in stages):
            for name in adapter.last:
                setattr(self, name, getattr(model, name))
        self.layer_list = adapter.layers

    def layer(self, index: int) -> nn.Module:
        return getattr(self, self.layer_list)[str(index)]

    def stage_parameters(self, stage: Stage, adapter: PipelineAdapter, with_first: bool = True) -> list[nn.Parameter]:
        """Trainable parameters stage `stage` uses (its layers, and its ends)."""
        modules = [self.layer(i) for i in stage.layers]
        if stage.first and with_first:
            modules += [getattr(self, n) for n in adapter.first]
        if stage.last:
            modules += [getattr(self, n) for n in adapter.last]
        seen, out = set(), []
        for m in modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def global_names(module: RankModule, tied: dict[str, str]) -> dict[str, str]:
    """Local parameter name -> global name (the same, except a tied head names its embedding)."""
    return {name: tied.get(name, name) for name, _ in module.named_parameters()}


def materialise(module: RankModule, device: torch.device, tied: dict[str, str],
                init: Callable[[object], None]) -> None:
    """Give a module built on the meta device real storage on `device`, initialised by global name.

    `init` receives an object whose named_parameters() yields (global name, parameter): the
    model's own initialiser then gives every parameter exactly its single-device value.
    """
    if not any(p.device.type == "meta" for p in module.parameters()):
        return
    module.to_empty(device=device)
    local = dict(module.named_parameters(remove_duplicate=False))
    for head_name, embed_name in tied.items():  # both ends on this rank: share the storage again
        if head_name in local and embed_name in local:
            owner, _, attr = head_name.rpartition(".")
            setattr(module.get_submodule(owner), attr, local[embed_name])
    names = global_names(module, tied)
    params = [(names[n], p) for n, p in module.named_parameters()]
    init(SimpleNamespace(named_parameters=lambda: iter(params)))
