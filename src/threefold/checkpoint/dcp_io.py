"""torch.distributed.checkpoint itself, for dcp.py: its metadata, a load of given boxes, a save.

Imported only when a DCP directory is read or written (importing torch.distributed.checkpoint
takes seconds: a run that never meets one does not pay for it). Everything runs on this process
alone (`no_dist=True`): no process group, no byte sent to another rank.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .format import CheckpointError


def is_tensor(stored) -> bool:
    """Whether a metadata entry is a tensor's (not pickled bytes)."""
    return isinstance(stored, TensorStorageMetadata)


def read_metadata(path: Path) -> Metadata:
    """The DCP directory's metadata (what is stored where); torch's error when it cannot be read."""
    return FileSystemReader(str(path)).read_metadata()


class _BoxPlanner(LoadPlanner):
    """DCP's load of given global boxes into given tensors: `requests` are (key, offsets, shape, target)."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]):
        self.requests = requests

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for i, (key, offsets, shape, _) in enumerate(self.requests):
            md = self.metadata.state_dict_metadata[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
            for item in create_read_items_for_chunk_list(key, md, [chunk]):
                items.append(dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, index=i)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise AssertionError(f"{read_item.dest_index.fqn}: only tensors are read")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.requests[read_item.dest_index.index][3]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The values were copied into the target's view (resolve_tensor)."""


def read_boxes(path: Path, requests: list) -> None:
    """One DCP load of all `requests` (key, global offsets, shape, target view) from directory `path`."""
    if not requests:
        return
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dist_cp.load({}, storage_reader=FileSystemReader(str(path)), planner=_BoxPlanner(requests),
                         no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # a missing or truncated .distcp file: torch's error, in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: reading the DCP checkpoint failed ({type(e).__name__}: {first})") \
            from None


def save(state_dict: dict, out: Path) -> None:
    """torch.distributed.checkpoint's own writer (FileSystemWriter) into directory `out`."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dist_cp.save(state_dict, storage_writer=FileSystemWriter(str(out)), no_dist=True)
