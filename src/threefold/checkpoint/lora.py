"""`ckpt export --hf OUT` of a LoRA checkpoint (parallel/lora.py): merged, or a PEFT adapter directory.

A LoRA checkpoint holds the adapters (`model/<...>.lora_A.weight`, `.lora_B.weight`) and their
optimizer state; the frozen base is named in `extra.lora_base` (its directory and fingerprint),
which the export checks before reading it.

    merged    the base directory's tensors, each target weight W + (alpha / r) B A (computed in
              fp32, written in the base tensor's dtype), in the base's own files and index, with
              its config.json and tokenizer files: a plain model for transformers' from_pretrained
    adapter   adapter_config.json + adapter_model.safetensors (peft's names, e.g.
              base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), which
              `peft.PeftModel.from_pretrained(base, OUT)` loads onto the base model
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.fingerprint import base_fingerprint, weight_files
from ..models.spec import HFFormat
from .format import DTYPES, CheckpointError, Manifest
from .reader import load_entries
from .state import Entry
from ..sharding import Placement

INDEX = "model.safetensors.index.json"
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_lora(manifest: Manifest) -> bool:
    return int(manifest.config.get("model", {}).get("lora_rank", 0)) > 0


def _whole(ckpt: Path, manifest: Manifest, name: str) -> torch.Tensor:
    info = manifest.tensors[name]
    full = torch.zeros(info.shape, dtype=DTYPES[info.dtype])
    load_entries(ckpt, {name: info}, [Entry(name, full, Placement.whole(name, info.shape))])
    return full


def _base(manifest: Manifest) -> Path:
    """The base directory the adapters were trained on, checked against the recorded fingerprint."""
    ref = manifest.extra.get("lora_base", {})
    source = Path(ref.get("source") or manifest.config["model"]["preset"].removeprefix("hf:"))
    if not (source / "config.json").is_file():
        raise CheckpointError(f"the LoRA base model {source} is gone; the checkpoint holds only the adapters")
    if ref.get("fingerprint") and base_fingerprint(source) != ref["fingerprint"]:
        raise CheckpointError(f"the weights of {source} are not the base the adapters were trained on "
                              f"(fingerprint {ref['fingerprint']}); restore that base model")
    return source


def export_lora(ckpt: Path, manifest: Manifest, fmt: HFFormat, out: Path, mode: str) -> int:
    """Write `out` (merged model or adapter directory); returns the number of tensors written."""
    m = manifest.config["model"]
    rank = int(m["lora_rank"])
    alpha = float(m.get("lora_alpha") or rank)
    source = _base(manifest)
    adapters = {n[len("model/"):]: _whole(ckpt, manifest, n) for n in sorted(manifest.tensors)
                if n.startswith("model/")}
    if mode == "adapter":
        tensors = {PEFT_PREFIX + fmt.key_of(name): t.contiguous() for name, t in adapters.items()}
        save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        targets = sorted({name.split(".")[-3] for name in adapters})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(source.resolve()),
                  "r": rank, "lora_alpha": alpha, "lora_dropout": float(m.get("lora_dropout", 0.0)),
                  "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
                  "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False}
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        return len(tensors)
    scaling = alpha / rank
    deltas = {}
    for name, a in adapters.items():
        if name.endswith("lora_A.weight"):
            base_name = name.removesuffix("lora_A.weight") + "weight"
            b = adapters[name.removesuffix("lora_A.weight") + "lora_B.weight"]
            deltas[fmt.key_of(base_name)] = scaling * (b.double() @ a.double())
    count, merged = 0, set()
    for path in weight_files(source):  # the base's own files, one at a time
        tensors = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key in deltas:
                    t = (t.double() + deltas[key]).to(t.dtype)
                    merged.add(key)
                tensors[key] = t
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        count += len(tensors)
    missing = set(deltas) - merged
    if missing:
        raise CheckpointError(f"{source}: no tensor {sorted(missing)[0]} to merge an adapter into")
    if (source / INDEX).is_file():
        shutil.copy2(source / INDEX, out / INDEX)
    (out / "config.json").write_text(json.dumps(fmt.config, indent=2))
    return count
