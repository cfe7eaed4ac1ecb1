"""One Hugging Face-style safetensors file of whole model tensors: export and import.

Export assembles each `model/<name>` tensor from its slices (one tensor in memory at a time
besides the output dict) and writes `<name>` keys - the reference model's module names - with
the model config as JSON metadata. Import (`checkpoint.init_from`) starts a run from such a
file under any layout: each rank reads only the boxes its placements hold.

Both keep every model tensor, the multi-token prediction depths (`mtp.<k>.*`, models/mtp.py)
included; a Hugging Face export (checkpoint/hf.py) drops those, whose format has no place for
them, and says so in one line (`hf_names`).
"""

from __future__ import annotations

import json
import sys
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


MTP_PREFIX = "mtp."  # the multi-token prediction depths' parameters (models/decoder.py, models/mtp.py)


def hf_names(names: list[str]) -> list[str]:
    """The model tensors a Hugging Face export writes: all but the multi-token prediction depths', whose
    dropping is said in one line on stderr (the depths only train; inference runs the main model)."""
    kept = [n for n in names if not n.startswith(MTP_PREFIX)]
    depths = {n.split(".")[1] for n in names if n.startswith(MTP_PREFIX)}
    if depths:
        print(f"threefold: export: {len(depths)} multi-token-prediction modules dropped (no place in the Hugging "
              "Face format)", file=sys.stderr, flush=True)
    return kept
