"""Which weights a Hugging Face directory holds, cheaply: the fingerprint a LoRA checkpoint records of its
frozen base (parallel/lora.py LoraBase) and the export checks (checkpoint/lora.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_INDEX = "model.safetensors.index.json"
SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # per weight file: the fingerprint reads these besides the header


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory (one, or those its index names)."""
    directory = Path(directory)
    if (directory / WEIGHT_INDEX).is_file():
        weight_map = json.loads((directory / WEIGHT_INDEX).read_text()).get("weight_map", {})
        return [directory / f for f in sorted(set(weight_map.values()))]
    return [directory / "model.safetensors"] if (directory / "model.safetensors").is_file() else []


def base_fingerprint(directory: Path) -> str:
    """sha256 over each weight file's name, size, safetensors header (names, dtypes, shapes, offsets)
    and 16 evenly spaced 64 KiB samples of its data: which base the adapters were trained on, read
    in milliseconds whatever the model's size (a full hash of 140 GB would take minutes)."""
    h = hashlib.sha256()
    for path in weight_files(directory):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            start = 8 + header_len
            span = max(0, size - start - SAMPLE_BYTES)
            for i in range(SAMPLES):
                f.seek(start + span * i // max(1, SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]
