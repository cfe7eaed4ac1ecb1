"""Universal load: fill local tensors of any layout from the slices of any checkpoint.

For each local piece (a global box this rank holds) and each stored slice of the same tensor
that overlaps it, read just the overlap with safetensors' `get_slice` (the file is memory
mapped; only the bytes of the overlap are touched) and copy it into the local storage view.
The layout the checkpoint was written with never matters: only boxes do.

The source is an index {tensor name: TensorInfo} - a checkpoint's manifest, or the header of a
single Hugging Face-style safetensors file of full tensors (`index_of_file`). A `FileSource`
may supply some files' tensors from memory (peer.py: the in-memory copies of a checkpoint);
the others are read from the directory. A file that is a symbolic link is refused unless the
caller allows links (a Hugging Face cache links its files to blobs; a checkpoint never does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from ..sharding import Placement
from .format import DTYPES, SAFETENSORS_DTYPES, CheckpointError, Slice, TensorInfo
from .pieces import intersect, local_pieces, local_view, relative
from .state import Entry

_SAFETENSORS_DTYPES = SAFETENSORS_DTYPES


_DTYPE_CODES = {getattr(torch, name): code for code, name in _SAFETENSORS_DTYPES.items()}


class FileSource(Protocol):
    """Tensors of a checkpoint file from elsewhere than the directory (verified by the source)."""

    def open(self, name: str) -> Mapping[str, torch.Tensor] | None:
        """The file's tensors by key, or None: read it from the directory."""


class _TensorSlice:
    """A loaded tensor behind safetensors' slice interface."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return _DTYPE_CODES.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


class _LoadedFile:
    """A file's tensors already in memory, behind safetensors' `safe_open` interface."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def get_slice(self, key: str) -> _TensorSlice:
        if key not in self.tensors:
            raise SafetensorError(f"no tensor {key}")
        return _TensorSlice(self.tensors[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key).tensor


class SliceReader:
    """Open safetensors files of one directory on demand (or take them from `source`); read
    boxes of stored slices."""

    def __init__(self, directory: Path, source: FileSource | None = None, follow_links: bool = False):
        self.directory = Path(directory)
        self.source = source
        self.follow_links = follow_links
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._open and self.source is not None:
            tensors = self.source.open(file)
            if tensors is not None:
                self._open[file] = _LoadedFile(tensors)
        if file not in self._open:
            path = self.directory / file
            if not self.follow_links and path.is_symlink():
                raise CheckpointError(f"{path}: is a symbolic link; a checkpoint's files must be its own "
                                      "(not followed)")
            try:
                self._open[file] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[file]

    def read(self, stored: Slice, info: TensorInfo, box) -> torch.Tensor:
        """Elements `box` (global coordinates, inside `stored`) of the stored slice."""
        handle = self._handle(stored.file)
        where = f"{self.directory / stored.file}: tensor '{stored.key}'"
        try:
            view = handle.get_slice(stored.key)
            shape, dtype = tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(view.get_dtype())
        except SafetensorError as e:
            raise CheckpointError(f"{where} cannot be read ({e})") from None
        if shape != tuple(stored.shape) or dtype != info.dtype:
            raise CheckpointError(f"{where} is {dtype} {list(shape)}, the manifest says {info.dtype} "
                                  f"{list(stored.shape)}")
        try:
            if not shape:
                return handle.get_tensor(stored.key)
            return view[relative(box, stored.offsets)]
        except SafetensorError as e:
            raise CheckpointError(f"{where} cannot be read ({e})") from None

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> "SliceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def load_entries(directory: Path, index: dict[str, TensorInfo], entries: list[Entry],
                 missing_ok: tuple[str, ...] = (), source: FileSource | None = None,
                 follow_links: bool = False) -> list[str]:
    """Fill every entry from the index; returns the names of entries absent from it.

    An entry whose name starts with one of `missing_ok` may be absent (e.g. optimizer state in
    an exported model file); any other absence, or a global shape that differs, is an error.
    `source` supplies files from memory (the others are read from `directory`); symbolic links
    are read only with `follow_links`.
    """
    absent = []
    with SliceReader(directory, source, follow_links) as reader:
        for entry in entries:
            info = index.get(entry.name)
            if info is None:
                if entry.name.startswith(missing_ok):
                    absent.append(entry.name)
                    continue
                raise CheckpointError(f"{directory}: the checkpoint has no tensor '{entry.name}' (the model or "
                                      "optimizer differs from the one that wrote it)")
            if tuple(info.shape) != tuple(entry.placement.global_shape):
                raise CheckpointError(f"{directory}: tensor '{entry.name}' has shape {list(info.shape)} in the "
                                      f"checkpoint, the model expects {list(entry.placement.global_shape)}; "
                                      "use the model config the checkpoint was written with")
            for piece in local_pieces(entry.placement):
                target = local_view(entry.tensor, entry.placement, piece)
                filled = 0
                for stored in info.slices:
                    overlap = intersect(piece.box, (stored.offsets, stored.shape))
                    if overlap is None:
                        continue
                    values = reader.read(stored, info, overlap)
                    target[relative(overlap, piece.offsets)].copy_(values)
                    filled += values.numel()
                if filled != piece.numel():
                    raise CheckpointError(f"{directory}: tensor '{entry.name}' covers only {filled} of the "
                                          f"{piece.numel()} elements of box {list(piece.offsets)}+{list(piece.shape)}")
    return absent


def whole_tensor(ckpt: Path, manifest, name: str) -> torch.Tensor:
    """Checkpoint tensor `name` of a verified checkpoint assembled whole from its slices."""
    info = manifest.tensors[name]
    full = torch.zeros(info.shape, dtype=DTYPES[info.dtype])  # verified: every element is filled, none is left as is
    load_entries(ckpt, {name: info}, [Entry(name, full, Placement.whole(name, info.shape))])
    return full


def index_of_file(path: Path) -> dict[str, TensorInfo]:
    """The index of one safetensors file of whole tensors (an export, or a Hugging Face checkpoint)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            index = {}
            for key in f.keys():
                view = f.get_slice(key)
                shape, dtype = tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(view.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{path}: tensor '{key}' has unsupported dtype {view.get_dtype()}")
                index[key] = TensorInfo(shape, dtype, (Slice(path.name, key, (0,) * len(shape), shape),))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return index

