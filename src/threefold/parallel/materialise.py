"""Give this rank's part of a model built on the meta device real storage and its values.

`parallelize()` builds the model on the meta device, shards it over tp and keeps its pipeline
stages there; only then does this step allocate the local tensors - nothing else is ever
allocated - and fill them, by placement, either from the model's pretrained weights (each rank
reads only the boxes it holds, `ModelSpec.weights`) or from its seeded initialisation
(`ModelSpec.init`, one whole tensor at a time, of which the local box is kept). Padding (a
vocabulary padded to a multiple of tp) is zero.

Parameters are swapped in place (`torch.utils.swap_tensors`): the objects the modules, the tied
ends and the plan's hooks refer to stay the same objects.

ZeRO-3 keeps only a 1/N chunk of each parameter: `defer_parameters` moves the buffers and leaves
the parameters on the meta device, and ZeRO-3 (zero3.py) asks the returned `Deferred` for one
unit's whole values at a time, keeps its chunk and drops them, so no more than one unit is ever
whole while the model is built (the values are the eager path's: the initialisation is by name,
the pretrained boxes the same reads, in the dtype the model was built in, before mixed precision
casts it). `Deferred.rest` fills whatever is still on the meta device afterwards (parameters no
ZeRO-3 holds).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.spec import ModelSpec
from ..sharding import Placement


def _local_box(place: Placement, whole: torch.Tensor, local: torch.Tensor) -> None:
    """Copy the part of `whole` (the global tensor) that `place` holds into `local`."""
    for seg in place.segments():
        seg.view(local, place).copy_(whole[tuple(slice(o, o + n) for o, n in zip(seg.offsets, seg.shape))])


def _meta_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named, seen = [], set()
    for name, p in module.named_parameters():
        if p.device.type == "meta" and id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def _fill(named: list[tuple[str, torch.Tensor]], placements: dict[str, Placement], spec: ModelSpec) -> None:
    """Each tensor of `named` (allocated, its parameter's local shape) gets its parameter's values."""
    if spec.weights is not None:
        spec.weights.load(named, placements)
    else:
        for name, p in named:
            place = placements[name]
            whole = spec.init(place.name, tuple(place.global_shape)).to(device=p.device, dtype=p.dtype)
            _local_box(place, whole, p.data)


@torch.no_grad()
def _materialise_parameters(module: nn.Module, placements: dict[str, Placement], device: torch.device,
                            spec: ModelSpec) -> int:
    named = _meta_parameters(module)
    for _, p in named:
        fresh = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, fresh)
    _fill(named, placements, spec)
    return sum(p.numel() * p.element_size() for _, p in named)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for owner in module.modules():
        for key, buf in list(owner._buffers.items()):
            if buf is not None and buf.device != device:
                if buf.device.type == "meta":
                    raise RuntimeError(f"{type(owner).__name__}.{key}: a buffer built on the meta device has no "
                                       "values; build it with an explicit device in the model family")
                owner._buffers[key] = buf.to(device)


class Deferred:
    """Parameters left on the meta device for ZeRO-3 to fill a unit at a time (`values`)."""

    def __init__(self, module: nn.Module, placements: dict[str, Placement], device: torch.device, spec: ModelSpec):
        meta = _meta_parameters(module)
        self.names = {id(p): name for name, p in meta}
        self.dtypes = {id(p): p.dtype for _, p in meta}  # as built: mixed precision casts the meta tensors later
        self.placements, self.device, self.spec = placements, device, spec
        self.bytes = 0  # filled so far

    def holds(self, p: torch.Tensor) -> bool:
        return id(p) in self.names and p.device.type == "meta"

    @torch.no_grad()
    def values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """New tensors on the device with the local values of `params` (meta parameters of the module), in the
        dtype the model was built in (the values the eager path fills in before any cast)."""
        out = [torch.zeros(p.shape, dtype=self.dtypes[id(p)], device=self.device) for p in params]
        _fill([(self.names[id(p)], t) for p, t in zip(params, out)], self.placements, self.spec)
        self.bytes += sum(t.numel() * t.element_size() for t in out)
        return out

    def rest(self, module: nn.Module) -> None:
        """Fill every parameter still on the meta device, whole (frozen ones: no master needs their fp32 values)."""
        named = _meta_parameters(module)
        for _, p in named:
            values = self.values([p])[0].to(p.dtype)
            torch.utils.swap_tensors(p, nn.Parameter(values, requires_grad=p.requires_grad))


def materialise(module: nn.Module, placements: dict[str, Placement], device: torch.device, spec: ModelSpec) -> int:
    """Allocate and fill every meta parameter of `module` on `device`; move its buffers there.

    Returns the bytes allocated. Placements must be boxes (no flat shards yet).
    """
    _move_buffers(module, device)
    return _materialise_parameters(module, placements, device, spec)


def defer_parameters(module: nn.Module, placements: dict[str, Placement], device: torch.device,
                     spec: ModelSpec) -> Deferred:
    """Move `module`'s buffers to `device`; leave its parameters on the meta device for ZeRO-3."""
    _move_buffers(module, device)
    return Deferred(module, placements, device, spec)
