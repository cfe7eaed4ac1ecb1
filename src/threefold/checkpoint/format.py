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

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..layout import Layout

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


def layout_record(layout: Layout, zero: int) -> dict:
    """The manifest's `layout`: dp, tp, pp, the ZeRO stage, the world size, and ep and cp when > 1
    (`Layout.fields`; cp is recorded only: parameters are replicated over cp, the checkpoint does not
    depend on it). The keys every version wrote; `Manifest.written_layout` reads them back."""
    sizes = layout.fields()
    return {**{k: sizes.pop(k) for k in ("dp", "tp", "pp")}, "zero": zero, "world_size": layout.world_size, **sizes}


@dataclass(frozen=True)
class Manifest:
    step: int
    layout: dict  # `layout_record`: {"dp", "tp", "pp", "zero", "world_size"} (+ "ep", "cp" when > 1)
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
                           "config": self.config}, separators=(",", ":"))  # C encoder: `indent` has none

    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    @property
    def written_layout(self) -> Layout | None:
        """The Layout the checkpoint was written with (a size the manifest does not name is 1); None
        where it names none (a torch.distributed.checkpoint directory)."""
        return Layout.from_fields(self.layout) if "dp" in self.layout else None


def read_manifest(ckpt: Path) -> Manifest:
    """The validated manifest of checkpoint directory `ckpt`; CheckpointError naming what is wrong."""
    path = Path(ckpt) / MANIFEST
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symbolic link; a checkpoint's files must be its own (not followed)")
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; not a complete threefold checkpoint")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: implausibly large manifest ({path.stat().st_size} bytes)")
    try:
        raw = strict_json(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, DuplicateKey) as e:
        raise CheckpointError(f"{path}: not a valid JSON manifest ({type(e).__name__}: {e})") from None
    return parse_manifest(raw, str(path))


class DuplicateKey(ValueError):
    """A JSON object names one key twice (json would silently keep the last)."""


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"key {key!r:.80} appears twice in one object")
        out[key] = value
    return out


def strict_json(text: str):
    """`json.loads` that refuses an object naming a key twice."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


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
    stored: dict[tuple[str, str], str] = {}  # (file, key) -> the slice it backs
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
            if (s["file"], s["key"]) in stored:
                raise bad(f"{where_s}.key", f"{s['key']!r:.80} of {s['file']} is also {stored[s['file'], s['key']]} "
                                            "(each stored tensor backs one slice)")
            stored[s["file"], s["key"]] = where_s
            slices.append(Slice(s["file"], s["key"], offsets, extent))
        _check_cover(name, shape, slices, bad)
        tensors[name] = TensorInfo(shape, dtype, tuple(slices))

    rng = _parse_rng(obj(raw.get("rng", {}), "rng"), obj, bad)
    return Manifest(step, layout, tensors, files, obj(raw.get("data", {}), "data"), rng,
                    obj(raw.get("extra", {}), "extra"), obj(raw.get("config", {}), "config"))


def _parse_rng(raw: dict, obj, bad) -> dict[int, dict[str, str]]:
    """The manifest's rng: {rank number: {generator name: base64 state}} (`obj`, `bad`: parse_manifest's checks)."""
    rng = {}
    for rank, states in raw.items():
        if not (isinstance(rank, str) and rank.isdigit()):
            raise bad("rng", f"key {rank!r:.40} is not a rank number")
        states = obj(states, f"rng.{rank}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in states.items()):
            raise bad(f"rng.{rank}", "must map generator names to base64 strings")
        rng[int(rank)] = dict(states)
    return rng


def _check_cover(name: str, shape: tuple[int, ...], slices: list[Slice], bad) -> None:
    """The slices of a tensor must tile it exactly: disjoint boxes (all inside the shape, checked
    by the caller) whose volumes add up to its size. Exact for any number of slices."""
    total = math.prod(shape)
    volume = sum(math.prod(s.shape) for s in slices)
    if volume != total:
        raise bad(f"tensors.{name}.slices", f"cover {volume} of the tensor's {total} elements")
    pair = first_overlap(shape, [(s.offsets, s.shape) for s in slices])
    if pair is not None:
        a, b = slices[pair[0]], slices[pair[1]]
        raise bad(f"tensors.{name}.slices", f"overlap at {list(a.offsets)}+{list(a.shape)} and "
                                            f"{list(b.offsets)}+{list(b.shape)} (so some element is covered "
                                            "twice and, the volumes adding up, another not at all)")


def first_overlap(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
                  ) -> tuple[int, int] | None:
    """Indices of two boxes (offsets, shape) of a tensor of `shape` that share an element, or None.

    Exact for any boxes. Empty boxes share nothing. When every box is a contiguous range of the
    row-major flattening (ZeRO's flat shards of a whole tensor are unions of such boxes), the
    ranges are sorted and neighbours compared: O(n log n). Otherwise a sweep along dimension 0
    (`_sweep`), which is O(n log n) for 1-d and 2-d tensors and for the boxes tensor parallelism
    and ZeRO within a tensor-parallel box produce.
    """
    items = [(tuple(o), tuple(e), i) for i, (o, e) in enumerate(boxes) if math.prod(e) > 0]
    if len(items) < 2:
        return None
    if not shape:  # scalars: two non-empty boxes are the same element
        return items[0][2], items[1][2]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    flat = []
    for o, e, i in items:
        k = next((d for d in range(len(e)) if e[d] != 1), len(e) - 1)
        if any(e[d] != shape[d] for d in range(k + 1, len(e))):
            break  # not one run of the flattening
        flat.append((sum(a * b for a, b in zip(o, strides)), math.prod(e), i))
    else:
        return _overlap_1d(flat)
    return _sweep(items, 0)


def _overlap_1d(ranges: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """Two of the (start, length, index) ranges that overlap, or None: sorted by start, each is
    compared with the one reaching furthest before it."""
    ranges = sorted(ranges)
    reach, owner = -1, -1
    for start, length, i in ranges:
        if start < reach:
            return owner, i
        if start + length > reach:
            reach, owner = start + length, i
    return None


def _sweep(items: list[tuple[tuple[int, ...], tuple[int, ...], int]], dim: int) -> tuple[int, int] | None:
    """Two overlapping boxes among the non-empty `items` (offsets, shape, index), compared in
    dimensions `dim` and later.

    Sweep along `dim`: at each coordinate the boxes ending there leave and those starting there
    enter; two boxes overlap exactly when one enters while the other is in and their extents in
    the later dimensions overlap. With one later dimension the boxes in are kept as disjoint
    intervals in a sorted list, so an entering one is compared with its two neighbours only
    (O(log n)); with more, the boxes in are checked in the next dimension whenever some entered.
    """
    ndim = len(items[0][0])
    if dim == ndim - 1:
        return _overlap_1d([(o[dim], e[dim], i) for o, e, i in items])
    events = sorted([(o[dim] + e[dim], 0, n) for n, (o, e, _) in enumerate(items)]
                    + [(o[dim], 1, n) for n, (o, e, _) in enumerate(items)])
    if dim == ndim - 2:
        starts: list[int] = []
        ends: list[int] = []
        owners: list[int] = []
        for _, kind, n in events:
            o, e, i = items[n]
            s, t = o[dim + 1], o[dim + 1] + e[dim + 1]
            pos = bisect.bisect_left(starts, s)
            if kind == 0:  # leaves: the intervals in are disjoint, so its start is unique
                del starts[pos], ends[pos], owners[pos]
                continue
            if pos > 0 and ends[pos - 1] > s:
                return owners[pos - 1], i
            if pos < len(starts) and starts[pos] < t:
                return owners[pos], i
            starts.insert(pos, s)
            ends.insert(pos, t)
            owners.insert(pos, i)
        return None
    inside: dict[int, None] = {}
    k = 0
    while k < len(events):
        coordinate, entered = events[k][0], False
        while k < len(events) and events[k][0] == coordinate:
            _, kind, n = events[k]
            if kind == 0:
                del inside[n]
            else:
                inside[n] = None
                entered = True
            k += 1
        if entered and len(inside) > 1:
            pair = _sweep([items[n] for n in inside], dim + 1)
            if pair is not None:
                return pair
    return None


# ---------------------------------------------------------------------- safetensors headers

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class StoredTensor:
    """One entry of a safetensors header: what the file holds under a key, and where."""

    dtype: str  # threefold's dtype name (DTYPES)
    shape: tuple[int, ...]
    start: int  # byte range in the data section
    end: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The header of safetensors file `path`, checked as safetensors checks it (an 8-byte
    length, a JSON object without repeated keys, every tensor's byte range the size of its
    dtype and shape, the ranges tiling the data section up to the end of the file); the file
    is opened without following a symbolic link. CheckpointError naming what is wrong."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a loadable safetensors file ({why})")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise bad(f"{e.strerror}; a symbolic link is not followed" if os.path.islink(path) else e.strerror) from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise bad(f"the header claims {n} bytes, the file has {size}")
        try:
            raw = strict_json(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, DuplicateKey) as e:
            raise bad(f"the header is not a JSON object: {type(e).__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise bad("the header is not a JSON object")
    out = {}
    for key, info in raw.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("__metadata__ must map names to strings")
            continue
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {key!r:.80} has no supported dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 16 and all(_natural(v) for v in shape)):
            raise bad(f"tensor {key!r:.80} has shape {shape!r:.60}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(v) for v in offsets)):
            raise bad(f"tensor {key!r:.80} has data_offsets {offsets!r:.60}")
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"tensor {key!r:.80} is {info['dtype']} {shape} ({nbytes} bytes) but its data_offsets "
                      f"{offsets} span {offsets[1] - offsets[0]}")
        out[key] = StoredTensor(dtype, tuple(shape), offsets[0], offsets[1])
    reach = 0
    for key, t in sorted(out.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != reach:
            raise bad(f"tensor {key!r:.80} starts at byte {t.start} of the data, not at {reach} (the header's "
                      "offsets overlap or leave a gap)")
        reach = t.end
    if 8 + n + reach != size:
        raise bad(f"the header accounts for {8 + n + reach} bytes, the file has {size}")
    return out


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
