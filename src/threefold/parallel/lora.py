"""LoRA: the base weights frozen, low-rank adapters trained beside the chosen linear layers.

`model.lora_rank = r > 0` gives every linear layer whose last name component is one of
`model.lora_targets` (default: the attention and MLP projections of a Llama-shaped model) two
adapter matrices, as `peft` does:

    y = base(x) + (alpha / r) * B(A(dropout(x)))      A: (r, in), B: (out, r)

A starts Kaiming-uniform (a = sqrt(5), peft's and torch.nn.Linear's default), seeded by its
global name as every threefold parameter is; B starts at zero, so training starts from the base
model exactly. Every other parameter (embedding, norms, head, the base weights) is frozen
(`requires_grad=False`): the gradient syncs, the optimizer, its masters and the gradient norm
see only the adapters, while ZeRO-3 still shards and gathers the frozen weights.

The adapters are added after tensor parallelism (step 1c of `parallelize`), as children
`lora_A` / `lora_B` of the base module and a forward hook on it, so the base parameters keep
their names (`...q_proj.weight`) and the adapters get peft's (`...q_proj.lora_A.weight`). Under
tp each adapter is split consistently with its base layer:

    column-parallel base (rows of W on this rank)   A whole, replicated over tp, its gradient
                                                    summed over tp (each rank's B rows see only
                                                    part of the output); B: the same rows as W
    grouped key/value heads kept whole (kv < tp)     A and B whole, B's output narrowed to the
                                                    rows the base uses; both gradients summed
    row-parallel base (columns of W on this rank)    A: the same columns as W; A x summed over
                                                    tp (an r-wide all-reduce, Megatron's g);
                                                    B whole, replicated over tp

Sequence parallelism, GPT-2's fused q/k/v and mixtures of experts are refused (ConfigError).
`lora_settings_from_peft` turns a `peft.LoraConfig` into the `model.lora_*` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..comm import Comm
from ..comm.autograd import reduce_from_group
from ..config.sections import LORA_DEFAULT_TARGETS, ParallelConfig
from ..errors import ConfigError, UserError
from ..mesh import Mesh
from ..models.decoder import parameter_seed
from ..models.fingerprint import base_fingerprint
from ..models.meta import on_meta
from ..models.spec import ModelSpec
from ..sharding import Placement
from .materialise import _local_box
from .tensor import ColumnParallelLinear, RowParallelLinear

DEFAULT_TARGETS = LORA_DEFAULT_TARGETS
ADAPTER_PARTS = ("lora_A", "lora_B")
# families whose linear layers are torch Linears (or threefold's parallel ones) named as in transformers
SUPPORTED_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_settings(model_cfg, seed: int) -> LoraSettings | None:
    """The `model.lora_*` keys as settings; None when LoRA is off (`model.lora_rank = 0`)."""
    if model_cfg.lora_rank <= 0:
        return None
    return LoraSettings(model_cfg.lora_rank, float(model_cfg.lora_alpha or model_cfg.lora_rank),
                        model_cfg.lora_dropout, model_cfg.lora_target_names, seed)


def lora_settings_from_peft(config) -> dict[str, object]:
    """A `peft.LoraConfig` as threefold's `model.lora_*` keys ({key: value}); what threefold does not
    do (DoRA, rsLoRA, trained biases, modules_to_save, per-module ranks, other initialisations) is
    refused with a ConfigError naming the field."""
    refused = {"use_dora": bool(getattr(config, "use_dora", False)),
               "use_rslora": bool(getattr(config, "use_rslora", False)),
               "bias": getattr(config, "bias", "none") != "none",
               "modules_to_save": bool(getattr(config, "modules_to_save", None)),
               "rank_pattern": bool(getattr(config, "rank_pattern", None)),
               "alpha_pattern": bool(getattr(config, "alpha_pattern", None)),
               "init_lora_weights": getattr(config, "init_lora_weights", True) is not True,
               "fan_in_fan_out": bool(getattr(config, "fan_in_fan_out", False))}
    for field, bad in refused.items():
        if bad:
            raise ConfigError(f"LoraConfig.{field}", "threefold's LoRA trains plain adapters (peft's defaults: "
                              "no DoRA or rsLoRA, bias='none', no modules_to_save, one rank, "
                              "init_lora_weights=True); leave it at its default")
    targets = config.target_modules
    if targets is None:
        targets = DEFAULT_TARGETS
    if isinstance(targets, str):
        raise ConfigError("LoraConfig.target_modules", "a regular expression is not supported; give module names")
    return {"model.lora_rank": int(config.r), "model.lora_alpha": float(config.lora_alpha),
            "model.lora_dropout": float(config.lora_dropout), "model.lora_targets": ",".join(sorted(targets))}


def is_adapter(name: str) -> bool:
    """Whether a global parameter name is a LoRA adapter's (`....lora_A.weight` / `....lora_B.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_PARTS


def is_adapter_module(name: str) -> bool:
    """Whether a module name is (inside) a LoRA adapter's: `....q_proj.lora_A`, peft's `....lora_B.default`."""
    return any(part in ADAPTER_PARTS for part in name.split("."))


def adapter_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A: Kaiming-uniform with a = sqrt(5) (bound 1/sqrt(in)), seeded by name; B: zeros (peft's scheme)."""
    if name.split(".")[-2] == "lora_B":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
    out = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)
    return out


class LoraWeights:
    """A `WeightSource` for a model with adapters: the base model's pretrained values from its own
    source, the adapters from their seeded initialisation."""

    def __init__(self, base, seed: int):
        self.base = base
        self.seed = seed

    def load(self, named_params, placements) -> None:
        base = [(n, p) for n, p in named_params if not is_adapter(placements[n].name)]
        self.base.load(base, placements)
        with torch.no_grad():
            for name, p in named_params:
                place = placements[name]
                if is_adapter(place.name):
                    whole = adapter_init(place.name, tuple(place.global_shape), self.seed)
                    _local_box(place, whole.to(device=p.device, dtype=p.dtype), p.data)

    @property
    def bytes_read(self) -> int:
        return self.base.bytes_read


def lora_spec(spec: ModelSpec, settings: LoraSettings) -> ModelSpec:
    """`spec` whose adapter parameters (once added) start from their own initialisation."""
    base_init = spec.init

    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return adapter_init(name, shape, settings.seed) if is_adapter(name) else base_init(name, shape)

    weights = LoraWeights(spec.weights, settings.seed) if spec.weights is not None else None
    return replace(spec, init=init, weights=weights)


class _Adapter:
    """The forward hook adding (alpha / r) B(A(dropout(x))) to a base layer's output."""

    def __init__(self, scaling: float, dropout: nn.Module, comm: Comm | None, rows: tuple[int, int] | None):
        self.scaling = scaling
        self.dropout = dropout
        self.comm = comm  # row-parallel base: A x is summed over tp
        self.rows = rows  # the rows of B's output the base uses (replicated grouped key/value heads)

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        # the adapters run as modules: the hooks a strategy put on them (ZeRO-1/2's wait for the
        # all-gather of their segment) fire
        a, b = module.lora_A, module.lora_B
        u = a(self.dropout(args[0].to(a.weight.dtype)))
        if self.comm is not None:
            u = reduce_from_group(u, self.comm, "tp")
        y = b(u)
        if self.rows is not None:
            y = y.narrow(-1, *self.rows)
        return output + (y * self.scaling).to(output.dtype)


def _targets(model: nn.Module, settings: LoraSettings) -> list[tuple[str, nn.Module]]:
    found = [(name, m) for name, m in model.named_modules()
             if name.rpartition(".")[2] in settings.targets
             and isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))]
    missing = set(settings.targets) - {name.rpartition(".")[2] for name, _ in found}
    if missing:
        linear = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                         if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear))})
        raise ConfigError("model.lora_targets", f"{', '.join(sorted(missing))} name no linear layer of the model; "
                          f"choose among {', '.join(linear)}")
    return found


def check_supported(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """LoRA with what it does not handle: one line naming it."""
    if spec.family not in SUPPORTED_FAMILIES:
        raise ConfigError("model.lora_rank", f"LoRA is implemented for the Hugging Face families "
                          f"{', '.join(SUPPORTED_FAMILIES)} (model.preset=hf:DIR), not {spec.family}; "
                          "set model.lora_rank=0")
    if parallel.sequence_parallel and parallel.tp > 1:
        raise ConfigError("model.lora_rank", "LoRA adapters are not split for sequence parallelism; "
                          "set parallel.sequence_parallel=false")


def add_adapters(model: nn.Module, placements: dict[str, Placement], partial: list[nn.Parameter], mesh: Mesh,
                 comm: Comm, settings: LoraSettings) -> list[str]:
    """Freeze `model` (tensor-parallel already, still on the meta device), give each target layer its
    adapters, record their placements in `placements` and the adapters whose gradient is summed over
    tp in `partial`. Returns the adapters' global names."""
    tp, r = mesh.size("tp"), settings.rank
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, module in _targets(model, settings):
        base = placements[f"{name}.weight"]
        if base.blocks != 1 or (isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.transposed):
            raise ConfigError("model.lora_targets", f"{name} is a fused or transposed projection; LoRA "
                              "supports plain linear layers only")
        (out_f, in_f), offsets, shape = base.global_shape, base.offsets, base.shape
        a_place = Placement.whole(f"{name}.lora_A.weight", (r, in_f))
        b_place = Placement.whole(f"{name}.lora_B.weight", (out_f, r))
        reduce, rows, summed = None, None, []
        if isinstance(module, RowParallelLinear):  # columns of W here: the same columns of A
            a_place = replace(a_place, offsets=(0, offsets[1]), shape=(r, shape[1]))
            b_place = b_place.replicated("tp")
            reduce = comm
        elif isinstance(module, ColumnParallelLinear) and tp > 1:
            a_place = a_place.replicated("tp")
            if "tp" in base.replicated_over:  # kept whole, some rows used: both summed over tp
                b_place, rows = b_place.replicated("tp"), module.rows
                summed = ["lora_B"]
            else:  # rows of W here: the same rows of B
                b_place = replace(b_place, offsets=(offsets[0], 0), shape=(shape[0], r))
            summed.append("lora_A")
        elif tp > 1:  # a plain Linear under tp: its input and output are replicated
            a_place, b_place = a_place.replicated("tp"), b_place.replicated("tp")
        with on_meta():
            module.lora_A = nn.Linear(a_place.shape[1], r, bias=False)
            module.lora_B = nn.Linear(r, b_place.shape[0], bias=False)
        dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        module.lora_dropout = dropout
        module.register_forward_hook(_Adapter(settings.scaling, dropout, reduce, rows))
        placements[a_place.name], placements[b_place.name] = a_place, b_place
        partial += [getattr(module, part).weight for part in summed]
        names += [a_place.name, b_place.name]
    return names



class LoraBase:
    """What a LoRA checkpoint records instead of the frozen base weights (`extra.lora_base`): the base
    directory, its fingerprint and the adapters' settings. A resume onto other base weights is refused."""

    def __init__(self, source: Path | None, settings: LoraSettings):
        self.source = Path(source) if source is not None else None
        self.settings = settings
        self.fingerprint = base_fingerprint(self.source) if self.source is not None else ""

    def state_dict(self) -> dict:
        s = self.settings
        return {"source": str(self.source or ""), "fingerprint": self.fingerprint, "rank": s.rank,
                "alpha": s.alpha, "dropout": s.dropout, "targets": list(s.targets)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise UserError(f"checkpoint.resume: the checkpoint's LoRA adapters were trained on the base weights "
                            f"of {state.get('source')} (fingerprint {state.get('fingerprint')}), but "
                            f"{self.source} has other weights ({self.fingerprint}); resume with that base model")
        if state.get("rank") != self.settings.rank:
            raise UserError(f"model.lora_rank: the checkpoint's adapters have rank {state.get('rank')}, not "
                            f"{self.settings.rank}; set model.lora_rank={state.get('rank')}")
