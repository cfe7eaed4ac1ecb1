"""What a checkpoint holds: named tensors with placements, RNG states and JSON extra state.

The training state is flattened into `Entry`s - a checkpoint tensor name, the local tensor and
its `Placement` - from nothing but `ParallelModel.placements`:

* `model/<name>`: every local parameter, with its own placement;
* `optim/<name>/<key>`: optimizer state. A state tensor shaped like its parameter has the
  parameter's placement; a scalar (Adam's `step`) is global and written by the rank that
  writes the parameter's first element. That is a `torch.optim.Optimizer`'s state; an
  optimizer that keeps its states in another shape (ZeRO's flat pieces, fp32 masters of bf16
  weights) is a `NamedStateOptimizer`: it names each state tensor with its own placement.

RNG states are raw generator bytes in base64 (JSON, never pickle); stateful helpers such as
the loss scaler contribute `state_dict()`s of plain JSON values.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import torch
from torch import nn

from ..sharding import Placement
from .format import DTYPES, CheckpointError, Manifest
from .pieces import holds_origin


class NamedStateOptimizer(Protocol):
    """An optimizer that is not a torch.optim.Optimizer and owns its state's storage and names."""

    def named_state(self) -> list[tuple[Placement, torch.Tensor]]:
        """(placement named optimizer.<kind>.<param>, local tensor) for every state tensor."""


Optimizer = torch.optim.Optimizer | NamedStateOptimizer


@dataclass(frozen=True)
class Entry:
    name: str  # checkpoint tensor name: model/<global name> or optim/<global name>/<key>
    tensor: torch.Tensor  # the local storage
    placement: Placement  # where it sits in the global tensor (its name is the checkpoint name)
    writer: bool = True  # False: never written by this rank even when it owns the copy


def model_entries(named_params, placements: dict[str, Placement]) -> list[Entry]:
    out = []
    for local_name, param in named_params:
        place = placements[local_name]
        name = f"model/{place.name}"
        out.append(Entry(name, param.detach(), replace(place, name=name)))
    return out


def optimizer_entries(optimizer: Optimizer, named_params, placements: dict[str, Placement]) -> list[Entry]:
    """The optimizer's state tensors as entries (what exists now: Adam states appear after step 1)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [_named_state_entry(place, tensor) for place, tensor in optimizer.named_state()]
    out = []
    for local_name, param in named_params:
        place = placements[local_name]
        for key, value in optimizer.state.get(param, {}).items():
            out.append(_state_entry(place, param, key, value))
    return out


def _named_state_entry(place: Placement, tensor: torch.Tensor) -> Entry:
    """optimizer.<kind>.<param> -> optim/<param>/<kind>, the checkpoint's own naming."""
    _, kind, param_name = place.name.split(".", 2)
    name = f"optim/{param_name}/{kind}"
    return Entry(name, tensor, replace(place, name=name))


def _state_entry(place: Placement, param: nn.Parameter, key: str, value) -> Entry:
    name = f"optim/{place.name}/{key}"
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"optimizer state '{key}' of {place.name} is a {type(value).__name__}, not a tensor; "
                              "give the optimizer a named_state() (checkpoint/state.py NamedStateOptimizer)")
    if value.shape == param.shape:
        return Entry(name, value, replace(place, name=name))
    if value.dim() == 0:
        scalar = Placement(name, (), (), (), None, place.replicated_over)
        return Entry(name, value, scalar, writer=holds_origin(place))
    raise CheckpointError(f"optimizer state '{key}' of {place.name} has shape {tuple(value.shape)}, neither the "
                          f"parameter's {tuple(param.shape)} nor a scalar; give the optimizer a named_state() with "
                          "its placements (checkpoint/state.py NamedStateOptimizer)")


def create_optimizer_state(optimizer: Optimizer, named_params, placements: dict[str, Placement],
                           manifest: Manifest) -> None:
    """Allocate the state tensors the checkpoint has for each local parameter, so loading can fill them.

    torch optimizers create their state lazily on the first step; a state that already exists
    is kept. Parameter-shaped states take the parameter's device, scalars stay on the CPU
    (where torch's Adam keeps `step` unless capturable).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # a NamedStateOptimizer owns its storage
    by_param: dict[str, list[str]] = {}
    for name in manifest.tensors:
        if name.startswith("optim/"):
            param_name, _, key = name[len("optim/"):].rpartition("/")
            by_param.setdefault(param_name, []).append(key)
    for local_name, param in named_params:
        place = placements[local_name]
        state = optimizer.state[param]
        for key in by_param.get(place.name, []):
            if key in state:
                continue
            info = manifest.tensors[f"optim/{place.name}/{key}"]
            dtype = DTYPES[info.dtype]
            if info.shape == tuple(place.global_shape):
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
            elif info.shape == ():
                state[key] = torch.zeros((), dtype=dtype)
            else:
                raise CheckpointError(f"checkpoint optimizer state optim/{place.name}/{key} has shape "
                                      f"{list(info.shape)}, which fits neither the parameter nor a scalar")


# ------------------------------------------------------------------ RNG


def capture_rng(device: torch.device) -> dict[str, str]:
    states = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["torch_cuda"] = torch.cuda.get_rng_state(device)
    return {k: base64.b64encode(v.numpy().tobytes()).decode("ascii") for k, v in states.items()}


def restore_rng(states: dict[str, str], device: torch.device) -> None:
    try:
        raw = {k: torch.frombuffer(bytearray(base64.b64decode(v, validate=True)), dtype=torch.uint8)
               for k, v in states.items()}
        if "torch_cpu" in raw:
            torch.set_rng_state(raw["torch_cpu"])
        if "torch_cuda" in raw and device.type == "cuda":
            torch.cuda.set_rng_state(raw["torch_cuda"], device)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's RNG state cannot be restored ({e})") from None


class UpdateGuard(Protocol):
    """What changes, in place, tensors that a checkpoint copies, and says so first: the optimizer
    (parameters, masters, moments), the gradient sync (ZeRO-1/2's parameter all-gathers, a
    compression hook's residuals), a periodic sync (replica state). An async save's snapshot runs
    on another thread; every such change waits for it through this hook (`Checkpointer.guard`)."""

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before each in-place change of a tensor that a checkpoint reads from this object."""


class RankState(UpdateGuard, Protocol):
    """Tensors of one rank alone (the gradient sync's compression residuals and momenta)."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


@dataclass
class TrainingState:
    """Everything of one rank that a checkpoint saves, as seen through placements."""

    named_params: list[tuple[str, nn.Parameter]]  # local name -> local parameter (all of them, frozen too)
    placements: dict[str, Placement]
    optimizer: Optimizer | None = None
    stateful: dict[str, object] = field(default_factory=dict)  # name -> object with state_dict()/load_state_dict()
    # Tensors that belong to this rank alone (gradient-compression residuals and momenta): saved
    # as rank/<global rank>/<key>, restored only under the same layout, dropped under another one
    # (their split over buckets and dp ranks would not fit).
    rank_state: RankState | None = None
    rank: int = 0
    layout: dict = field(default_factory=dict)  # the manifest's layout this run writes (format.py layout_record)
    _pending: dict = field(default_factory=dict, repr=False)

    def _rank_prefix(self) -> str:
        return f"rank/{self.rank:05d}/"

    def rank_entries(self, tensors: dict[str, torch.Tensor]) -> list[Entry]:
        return [Entry(self._rank_prefix() + key, t, Placement.whole(self._rank_prefix() + key, t.shape))
                for key, t in tensors.items()]

    def entries(self) -> list[Entry]:
        out = model_entries(self.named_params, self.placements)
        if self.optimizer is not None:
            out += optimizer_entries(self.optimizer, self.trainable(), self.placements)
        if self.rank_state is not None:
            out += self.rank_entries(self.rank_state.state_dict())
        return out

    def trainable(self):
        return [(n, p) for n, p in self.named_params if p.requires_grad]

    def entries_to_load(self, manifest: Manifest) -> list[Entry]:
        """What to fill from `manifest`; fp32 masters are optional (absent when written in fp32:
        the optimizer then takes them from the loaded parameters)."""
        if self.optimizer is not None:
            create_optimizer_state(self.optimizer, self.trainable(), self.placements, manifest)
        out = [e for e in self.entries() if e.name in manifest.tensors or not e.name.endswith("/master")]
        out = [e for e in out if not e.name.startswith("rank/")]
        self._pending = {}
        if self.rank_state is not None and manifest.layout == self.layout:
            prefix = self._rank_prefix()
            self._pending = {name[len(prefix):]: torch.zeros(info.shape, dtype=DTYPES[info.dtype])
                             for name, info in manifest.tensors.items() if name.startswith(prefix)}
            out += self.rank_entries(self._pending)
        return out

    def extra(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.stateful.items()}

    def load_extra(self, extra: dict) -> None:
        for name, obj in self.stateful.items():
            if name in extra:
                obj.load_state_dict(extra[name])
        if self._pending:
            self.rank_state.load_state_dict(self._pending)
            self._pending = {}
