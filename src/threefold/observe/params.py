"""Full global parameters of any layout, through the placement contract only.

`dump_owned` (every rank, at the end of a run with debug.dump_params) writes the parts of the
global tensors this rank owns - a copy replicated over an axis is written by that axis's
coordinate 0 only - to DIR/params/rank-N.safetensors, one entry per box of
`Placement.boxes()`, keyed "<global name>@<offsets>" with the global shapes in the metadata.
`load_global` (one process, afterwards) assembles every global tensor from all ranks' files and
checks that each element was written exactly once. Nothing here knows the strategies: any
layout whose placements are true reassembles.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..mesh import Mesh
from ..sharding import Placement


def owned_boxes(local: torch.Tensor, place: Placement) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offsets, values) of each box of the global tensor `local` holds (padding dropped)."""
    local = local.detach()
    assert local.numel() == place.numel(), f"{place.name}: {local.numel()} elements, placement says {place.numel()}"
    return [(seg.offsets, seg.view(local, place)) for seg in place.segments()]


def dump_owned(named_params, placements: dict[str, Placement], mesh: Mesh, directory: Path) -> Path:
    tensors, shapes = {}, {}
    for name, param in named_params:
        place = placements[name]
        if any(mesh.rank(axis) != 0 for axis in place.replicated_over):
            continue
        shapes[place.name] = list(place.global_shape)
        for start, values in owned_boxes(param, place):
            tensors[f"{place.name}@{','.join(map(str, start))}"] = values.float().cpu().contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{mesh.global_rank}.safetensors"
    save_file(tensors, str(path), metadata={"global_shapes": json.dumps(shapes)})
    return path


def load_global(directory: Path) -> dict[str, torch.Tensor]:
    """Every global parameter (fp32), assembled from all rank files in `directory`."""
    from safetensors import safe_open

    shapes, boxes = {}, []
    for path in sorted(Path(directory).glob("rank-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes.update(json.loads(f.metadata()["global_shapes"]))
        for key, values in load_file(str(path)).items():
            name, _, offsets = key.rpartition("@")
            boxes.append((name, tuple(int(o) for o in offsets.split(",") if o), values))
    if not shapes:
        raise FileNotFoundError(f"no parameter files in {directory}")
    full = {name: torch.zeros(shape) for name, shape in shapes.items()}
    written = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    for name, start, values in boxes:
        index = tuple(slice(s, s + n) for s, n in zip(start, values.shape))
        full[name][index] = values
        written[name][index] += 1
    for name, count in written.items():
        if not bool((count == 1).all()):
            raise ValueError(f"{name}: the ranks' boxes cover {int((count > 0).sum())} of {count.numel()} elements "
                             f"({int((count > 1).sum())} more than once): the placements are wrong")
    return full
