"""Give this rank's part of a model built on the meta device real storage and its values.

`parallelize()` builds the model on the meta device, shards it over tp and keeps its pipeline
stages there; only then does this step allocate the local tensors - nothing else is ever
allocated - and fill them, by placement, either from the model's pretrained weights (each rank
reads only the boxes it holds, `ModelSpec.weights`) or from its seeded initialisation
(`ModelSpec.init`, one whole tensor at a time, of which the local box is kept). Padding (a
vocabulary padded to a multiple of tp) is zero.

Parameters are swapped in place (`torch.utils.swap_tensors`): the objects the modules, the tied
ends and the plan's hooks refer to stay the same objects.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.spec import ModelSpec
from ..sharding import Placement


def _local_box(place: Placement, whole: torch.Tensor, local: torch.Tensor) -> None:
    """Copy the part of `whole` (the global tensor) that `place` holds into `local` (a box)."""
    for offsets, shape in place.boxes():
        target = local
        for dim, (o, base, n) in enumerate(zip(offsets, place.offsets, shape)):
            target = target.narrow(dim, o - base, n)
        target.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offsets, shape))])


@torch.no_grad()
def materialise(module: nn.Module, placements: dict[str, Placement], device: torch.device, spec: ModelSpec) -> int:
    """Allocate and fill every meta parameter of `module` on `device`; move its buffers there.

    Returns the bytes allocated. Placements must be boxes (no flat shards yet).
    """
    named, seen = [], set()
    for name, p in module.named_parameters():
        if p.device.type != "meta" or id(p) in seen:
            continue
        seen.add(id(p))
        fresh = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, fresh)
        named.append((name, p))
    for owner in module.modules():
        for key, buf in list(owner._buffers.items()):
            if buf is not None and buf.device != device:
                if buf.device.type == "meta":
                    raise RuntimeError(f"{type(owner).__name__}.{key}: a buffer built on the meta device has no "
                                       "values; build it with an explicit device in the model family")
                owner._buffers[key] = buf.to(device)
    if spec.weights is not None:
        spec.weights.load(named, placements)
    else:
        for name, p in named:
            place = placements[name]
            whole = spec.init(place.name, tuple(place.global_shape)).to(device=device, dtype=p.dtype)
            _local_box(place, whole, p.data)
    return sum(p.numel() * p.element_size() for _, p in named)
