"""Hugging Face model directories: pretrained weights in, trained weights out.

In (`HFWeights`, `pretrained`): a directory with config.json and `model.safetensors`, or
sharded `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Each rank fills
its local tensors from the boxes its placements hold, read with safetensors' `get_slice`
straight from the memory-mapped files (reader.py): no rank reads or holds the whole model. A
stacked parameter whose checkpoint keeps one tensor per row (`ROW` in its key: Mixtral's and
Qwen-MoE's experts) is read row by row, each rank reading only its own experts' tensors.

Out (`export_hf`): a checkpoint's model tensors as the family's `spec.hf` describes them (Hugging
Face names; for the reference decoder also reordered / fused / transposed: models/reference_hf.py),
in shards of at most `shard_bytes` with their index, the config.json (with the written dtype)
and the source's tokenizer files, so `transformers.AutoModelForCausalLM.from_pretrained(OUT)` opens it.
Stacked parameters are written one tensor per row, as the library's save_pretrained writes them.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..models.spec import ROW, HFFormat, HFTensor, ModelSpec
from ..sharding import Placement
from .format import DTYPES, CheckpointError, Slice, TensorInfo
from .export import hf_names
from .lora import export_lora, is_lora
from .pieces import local_pieces, local_view
from .reader import _SAFETENSORS_DTYPES, index_of_file, load_entries, whole_tensor
from .state import Entry
from .verify import find_checkpoint_dir, verify

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def has_weights(directory: Path) -> bool:
    return (Path(directory) / INDEX).is_file() or (Path(directory) / SINGLE).is_file()


def hf_index(directory: Path) -> dict[str, TensorInfo]:
    """{Hugging Face key: stored tensor} of a directory's safetensors files (headers only)."""
    directory = Path(directory)
    if (directory / SINGLE).is_file() and not (directory / INDEX).is_file():
        return index_of_file(directory / SINGLE)
    try:
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{directory / INDEX}: not a safetensors index with a weight_map ({e})") from None
    index = {}
    for file in sorted(set(weight_map.values())):
        path = directory / file
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    shape = tuple(view.get_shape())
                    index[key] = TensorInfo(shape, _SAFETENSORS_DTYPES.get(view.get_dtype(), "?"),
                                            (Slice(file, key, (0,) * len(shape), shape),))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); {INDEX} lists it") from None
    return index


class HFWeights:
    """Pretrained values of a Hugging Face directory for `parallelize` (a `WeightSource`)."""

    def __init__(self, directory: Path, fmt: HFFormat):
        self.directory = Path(directory)
        self.fmt = fmt
        self.bytes_read = 0  # bytes of the boxes this rank asked for (what get_slice reads)

    @torch.no_grad()
    def load(self, named_params: list[tuple[str, nn.Parameter]], placements: dict[str, Placement]) -> None:
        index = hf_index(self.directory)
        entries = []
        for local_name, param in named_params:
            place = placements[local_name]
            key = self.fmt.key_of(place.name)
            parts = _row_entries(key, param.data, place) if ROW in key else [Entry(key, param.data,
                                                                                  replace(place, name=key))]
            for entry in parts:
                self._check(index, entry.name, entry.placement.global_shape, place.name)
            entries += parts
            info = index[parts[0].name]
            size = torch.empty((), dtype=DTYPES.get(info.dtype, torch.float32)).element_size()
            self.bytes_read += size * sum(p.numel() for p in local_pieces(place))
        load_entries(self.directory, index, entries, follow_links=True)  # a Hugging Face cache links to blobs

    def _check(self, index: dict[str, TensorInfo], key: str, shape: tuple[int, ...], name: str) -> None:
        info = index.get(key)
        if info is None:
            raise CheckpointError(f"{self.directory}: no tensor '{key}' in the safetensors files (parameter "
                                  f"{name}); the weights do not belong to this config.json")
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(f"{self.directory / info.slices[0].file}: tensor '{key}' has shape "
                                  f"{list(info.shape)}, config.json implies {list(shape)}; use the config.json "
                                  "the weights were saved with")


def _row_entries(key: str, local: torch.Tensor, place: Placement) -> list[Entry]:
    """Entries filling a stacked parameter (held under `place`) from one checkpoint tensor per row
    of dimension 0 (`key` with ROW): for every held box and row, that row's part of the box."""
    out = []
    for piece in local_pieces(place):
        target = local_view(local, place, piece)
        for i in range(piece.shape[0]):
            row_key = key.replace(ROW, str(piece.offsets[0] + i))
            out.append(Entry(row_key, target[i], Placement(row_key, place.global_shape[1:], piece.offsets[1:],
                                                           piece.shape[1:])))
    return out


def pretrained(spec: ModelSpec) -> ModelSpec:
    """`spec` starting from the weights of the directory it came from, when that has any."""
    if spec.hf is None or spec.hf.source is None or not has_weights(spec.hf.source):
        return spec
    return replace(spec, weights=HFWeights(spec.hf.source, spec.hf))


def _hf_format_of(manifest) -> HFFormat:
    from ..config import ModelConfig
    from ..models.registry import model_spec

    from ..models.reference_hf import why_not

    cfg = ModelConfig(**manifest.config.get("model", {}))
    spec = model_spec(cfg, 0)
    if spec.hf is None:
        raise CheckpointError(f"checkpoint of model.preset={cfg.preset}: {why_not(cfg)}; export it with "
                              "`ckpt export CKPT FILE` (threefold's own names) instead of --hf")
    return spec.hf


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * torch.empty((), dtype=DTYPES[info.dtype]).element_size()


def _by_row(tensors: list[HFTensor], manifest) -> list[HFTensor]:
    """The tensors with every stacked one (a key with ROW) written as one tensor per row."""
    out = []
    for t in tensors:
        if ROW not in t.key:
            out.append(t)
            continue
        rows = manifest.tensors[f"model/{t.sources[0]}"].shape[0]
        out += [HFTensor(t.key.replace(ROW, str(r)), t.sources, t.combine, row=r) for r in range(rows)]
    return out


def export_hf(path: Path, out: Path, shard_bytes: int = 2 * 2**30, lora: str = "merged") -> tuple[Path, int]:
    """Write checkpoint `path` (verified first) as a Hugging Face model directory `out`; (checkpoint, tensors).
    A LoRA checkpoint (adapters + a reference to the base) is written merged into its base, or, with
    `lora="adapter"`, as a PEFT adapter directory (checkpoint/lora.py)."""
    ckpt = find_checkpoint_dir(path)
    manifest, problems = verify(ckpt)
    if problems:
        raise CheckpointError(f"{ckpt} failed verification: {'; '.join(problems)}")
    fmt = _hf_format_of(manifest)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; give a new directory for the export")
    out.mkdir(parents=True, exist_ok=True)
    if is_lora(manifest):
        count = export_lora(ckpt, manifest, fmt, out, lora)
        if lora == "merged" and fmt.source is not None:
            _copy_tokenizer(fmt.source, out)
        return ckpt, count
    if lora != "merged":
        raise CheckpointError(f"{ckpt} holds no LoRA adapters (model.lora_rank=0); --lora {lora} needs a LoRA run")
    names = hf_names(sorted(n[len("model/"):] for n in manifest.tensors if n.startswith("model/")))
    shards, current, size = [], [], 0
    for hf_tensor in _by_row(fmt.tensors(names), manifest):
        nbytes = sum(_nbytes(manifest.tensors[f"model/{n}"]) for n in hf_tensor.sources)
        if hf_tensor.row is not None:
            nbytes //= manifest.tensors[f"model/{hf_tensor.sources[0]}"].shape[0]
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(hf_tensor)
        size += nbytes
    shards.append(current)
    weight_map, dtypes, total = {}, set(), 0
    last: tuple[tuple[str, ...], list[torch.Tensor]] = ((), [])  # stacked sources serve several rows in a row
    for i, shard in enumerate(shards):
        file = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for hf_tensor in shard:  # one shard's tensors in memory at a time
            if last[0] != hf_tensor.sources:
                last = (hf_tensor.sources, [whole_tensor(ckpt, manifest, f"model/{n}") for n in hf_tensor.sources])
            parts = last[1]
            full = parts[0] if hf_tensor.combine is None else hf_tensor.combine(parts)
            if hf_tensor.row is not None:
                full = full[hf_tensor.row].clone()  # its own storage: safetensors writes whole storages
            tensors[hf_tensor.key] = full
            weight_map[hf_tensor.key] = file
            dtypes.add(full.dtype)
            total += full.numel() * full.element_size()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = dict(fmt.config)
    if len(dtypes) == 1:
        config["torch_dtype"] = config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if fmt.source is not None:
        _copy_tokenizer(fmt.source, out)
    return ckpt, len(weight_map)


def _copy_tokenizer(source: Path, out: Path) -> None:
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy2(source / file, out / file)
