"""One Hugging Face-style safetensors file of whole model tensors: export and import.

Export assembles each `model/<name>` tensor from its slices (one tensor in memory at a time
besides the output dict) and writes `<name>` keys - the reference model's module names - with
the model config as JSON metadata. Import (`checkpoint.init_from`) starts a run from such a
file under any layout: each rank reads only the boxes its placements hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from ..sharding import Placement
from .format import CheckpointError
from .reader import index_of_file, load_entries, whole_tensor
from .state import model_entries
from .verify import find_checkpoint_dir, verify


def export_model(path: Path, out: Path) -> tuple[Path, int]:
    """Write the model tensors of checkpoint `path` (verified first) to `out`; returns (checkpoint, count)."""
    ckpt = find_checkpoint_dir(path)
    manifest, problems = verify(ckpt)
    if problems:
        raise CheckpointError(f"{ckpt} failed verification: {'; '.join(problems)}")
    tensors = {}
    for name, info in sorted(manifest.tensors.items()):
        if not name.startswith("model/"):
            continue
        tensors[name[len("model/"):]] = whole_tensor(ckpt, manifest, name)
    if not tensors:
        raise CheckpointError(f"{ckpt} holds no model tensors")
    metadata = {"format": "pt", "threefold_step": str(manifest.step),
                "threefold_model": json.dumps(manifest.config.get("model", {}))}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return ckpt, len(tensors)


def import_model(path: Path, named_params, placements: dict[str, Placement]) -> None:
    """Fill this rank's parameters from a safetensors file of whole tensors named like the model's."""
    path = Path(path)
    index = {f"model/{name}": info for name, info in index_of_file(path).items()}
    load_entries(path.parent, index, model_entries(named_params, placements), follow_links=True)
