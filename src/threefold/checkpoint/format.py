"""The on-disk format: directory names, the JSON manifest and its strict validation.

    DIR/checkpoints/step-00000010/
        manifest.json             what is where (below); written last, by rank 0
        rank-00000.safetensors    the slices rank 0 owns (one file per writing rank)
        rank-00003.safetensors    ...

A checkpoint is written under `.step-00000010.partial/` and renamed to `step-00000010/` only
when every file is written and fsynced, so a visible step directory is always complete.

The manifest (format version 1) records the step, the layout it was written with, every
tensor's global shape and dtype and the boxes of it each file holds, each file's size and
sha256, the data position (the step: the sampler is a pure function of it), each rank's RNG
states and JSON-able extra state (the loss scaler). Tensors are named `model/<parameter>`
and `optim/<parameter>/<state key>` with the global (single-device) parameter names.

Nothing here executes code from the checkpoint: the manifest is JSON checked field by field
against this schema, file names must be plain `rank-NNNNN.safetensors` names inside the
checkpoint directory, and tensors are read with safetensors only (never pickle).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

FORMAT = "threefold-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
MAX_MANIFEST_BYTES = 512 * 2**20

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_DATA_FILE = re.compile(r"^rank-(\d{5})\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt, hostile, or does not fit the model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir_name(step: int) -> str:
    return f".{step_dir_name(step)}{PARTIAL_SUFFIX}"


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def step_of(path: Path) -> int | None:
    """The step of a complete checkpoint directory's name, None for anything else."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def piece_key(name: str, offsets: tuple[int, ...]) -> str:
    """The safetensors key of the box of `name` that starts at `offsets` (unique within a file)."""
    return f"{name}@{','.join(map(str, offsets))}"


@dataclass(frozen=True)
class Slice:
    """One box of a global tensor, stored whole under `key` in `file`."""

    file: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # global shape
    dtype: str
    slices: tuple[Slice, ...]


@dataclass(frozen=True)
class FileInfo:
    rank: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    layout: dict  # {"dp", "tp", "pp", "zero", "world_size"}
    tensors: dict[str, TensorInfo]
    files: dict[str, FileInfo]
    data: dict = field(default_factory=dict)  # {"step", "samples", "global_batch", "seq_len", "seed"}
    rng: dict[int, dict[str, str]] = field(default_factory=dict)  # rank -> {"torch_cpu": base64, ...}
    extra: dict = field(default_factory=dict)  # JSON state of stateful helpers, e.g. {"loss_scaler": {...}}
    config: dict = field(default_factory=dict)  # the writer's whole config, for inspection

    def to_json(self) -> str:
        tensors = {name: {"shape": list(t.shape), "dtype": t.dtype,
                          "slices": [{"file": s.file, "key": s.key, "offsets": list(s.offsets), "shape": list(s.shape)}
                                     for s in t.slices]}
                   for name, t in sorted(self.tensors.items())}
        files = {name: {"rank": f.rank, "bytes": f.bytes, "sha256": f.sha256} for name, f in sorted(self.files.items())}
        return json.dumps({"format": FORMAT, "version": VERSION, "step": self.step, "layout": self.layout,
                           "data": self.data, "files": files, "tensors": tensors,
                           "rng": {str(r): s for r, s in sorted(self.rng.items())}, "extra": self.extra,
                           "config": self.config}, indent=1)

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def read_manifest(ckpt: Path) -> Manifest:
    """The validated manifest of checkpoint directory `ckpt`; CheckpointError naming what is wrong."""
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; not a complete threefold checkpoint")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: implausibly large manifest ({path.stat().st_size} bytes)")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a valid JSON manifest ({type(e).__name__}: {e})") from None
    return parse_manifest(raw, str(path))


def parse_manifest(raw, where: str) -> Manifest:
    """Check every field of a decoded manifest against the schema; build the Manifest."""
    def bad(field_name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where}: manifest field '{field_name}' {why}")

    def obj(value, name) -> dict:
        if not isinstance(value, dict):
            raise bad(name, f"must be an object, got {type(value).__name__}")
        return value

    def integer(value, name, low=0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise bad(name, f"must be an integer >= {low}, got {value!r:.60}")
        return value

    def ints(value, name) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > 16:
            raise bad(name, f"must be a list of at most 16 integers, got {value!r:.60}")
        return tuple(integer(v, name) for v in value)

    raw = obj(raw, "(top level)")
    if raw.get("format") != FORMAT:
        raise bad("format", f"must be '{FORMAT}', got {raw.get('format')!r:.60}")
    if raw.get("version") != VERSION:
        raise bad("version", f"{raw.get('version')!r:.20} is not supported (this threefold reads version {VERSION})")
    step = integer(raw.get("step"), "step")
    layout = {k: integer(v, f"layout.{k}") for k, v in obj(raw.get("layout"), "layout").items()}

    files = {}
    for name, info in obj(raw.get("files"), "files").items():
        match = _DATA_FILE.match(name) if isinstance(name, str) else None
        if not match:
            raise bad("files", f"names a file {name!r:.80} that is not a plain rank-NNNNN.safetensors name")
        info = obj(info, f"files.{name}")
        sha = info.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise bad(f"files.{name}.sha256", "must be 64 lowercase hex digits")
        files[name] = FileInfo(integer(info.get("rank"), f"files.{name}.rank"),
                               integer(info.get("bytes"), f"files.{name}.bytes"), sha)

    tensors = {}
    for name, info in obj(raw.get("tensors"), "tensors").items():
        if not isinstance(name, str) or not name:
            raise bad("tensors", "has a tensor without a name")
        info = obj(info, f"tensors.{name}")
        shape = ints(info.get("shape"), f"tensors.{name}.shape")
        dtype = info.get("dtype")
        if dtype not in DTYPES:
            raise bad(f"tensors.{name}.dtype", f"{dtype!r:.40} is not one of {', '.join(DTYPES)}")
        raw_slices = info.get("slices")
        if not isinstance(raw_slices, list):
            raise bad(f"tensors.{name}.slices", "must be a list")
        slices = []
        for i, s in enumerate(raw_slices):
            where_s = f"tensors.{name}.slices[{i}]"
            s = obj(s, where_s)
            if s.get("file") not in files:
                raise bad(f"{where_s}.file", f"{s.get('file')!r:.80} is not listed in 'files'")
            if not isinstance(s.get("key"), str):
                raise bad(f"{where_s}.key", "must be a string")
            offsets, extent = ints(s.get("offsets"), f"{where_s}.offsets"), ints(s.get("shape"), f"{where_s}.shape")
            if len(offsets) != len(shape) or len(extent) != len(shape):
                raise bad(where_s, f"has {len(offsets)}-d offsets / {len(extent)}-d shape for a {len(shape)}-d tensor")
            if any(o + e > g for o, e, g in zip(offsets, extent, shape)):
                raise bad(where_s, f"box {list(offsets)}+{list(extent)} reaches outside the shape {list(shape)}")
            slices.append(Slice(s["file"], s["key"], offsets, extent))
        _check_cover(name, shape, slices, bad)
        tensors[name] = TensorInfo(shape, dtype, tuple(slices))

    rng = {}
    for rank, states in obj(raw.get("rng", {}), "rng").items():
        if not (isinstance(rank, str) and rank.isdigit()):
            raise bad("rng", f"key {rank!r:.40} is not a rank number")
        states = obj(states, f"rng.{rank}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in states.items()):
            raise bad(f"rng.{rank}", "must map generator names to base64 strings")
        rng[int(rank)] = dict(states)
    return Manifest(step, layout, tensors, files, obj(raw.get("data", {}), "data"), rng,
                    obj(raw.get("extra", {}), "extra"), obj(raw.get("config", {}), "config"))


def _check_cover(name: str, shape: tuple[int, ...], slices: list[Slice], bad) -> None:
    """The slices of a tensor must tile it exactly: disjoint boxes whose volumes add up to its size."""
    total = math.prod(shape)
    volume = sum(math.prod(s.shape) for s in slices)
    if volume != total:
        raise bad(f"tensors.{name}.slices", f"cover {volume} of the tensor's {total} elements")
    if len(slices) <= 512:  # disjointness, pairwise (a tensor has a handful of slices per writer)
        for i, a in enumerate(slices):
            for b in slices[i + 1:]:
                if all(max(ao, bo) < min(ao + ae, bo + be)
                       for ao, ae, bo, be in zip(a.offsets, a.shape, b.offsets, b.shape)) and math.prod(a.shape):
                    raise bad(f"tensors.{name}.slices", f"overlap at {list(a.offsets)} and {list(b.offsets)}")
