"""Writing a checkpoint: snapshot to host memory, one file per rank, then an atomic rename.

1. `snapshot` (training paused): copy the pieces this rank owns into fresh host tensors
   (pinned when the source is on a GPU). After it, training may change the parameters.
2. `write_rank` (inline, or on a background thread): the rank's safetensors file, fsynced and
   hashed, then a small `rank-NNNNN.part.json` record of what the file holds, written to a
   temporary name, fsynced and renamed - its presence means the rank is done.
3. `finalize` (rank 0): wait for every rank's part record, merge them into `manifest.json`,
   fsync, rename `.step-N.partial/` to `step-N/`, fsync the parent, prune old checkpoints.

A process killed anywhere before the rename leaves only the hidden partial directory, which
no reader looks at and the next save removes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save, save_file

from .format import (DTYPE_NAMES, MANIFEST, PARTIAL_SUFFIX, CheckpointError, FileInfo, Manifest, Slice, TensorInfo,
                     data_file_name, parse_manifest, piece_key, step_dir_name, step_of)
from .pieces import is_owner, local_pieces, local_view
from .state import Entry


@dataclass(frozen=True)
class SavedPiece:
    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor  # host copy of the box, contiguous


def snapshot(entries: list[Entry], coords: dict[str, int], staging: dict | None = None,
             ready: tuple | None = None) -> list[SavedPiece]:
    """Host copies of every piece this rank owns: after it, training may change the tensors.

    `staging` keeps the host buffers from one save to the next (async saves): refilling warm
    memory is several times faster than faulting in fresh pages. The caller must not reuse it
    before the previous write has finished. GPU tensors are copied to pinned memory on a side
    stream that first waits for `ready` = (device, CUDA event recorded by the training thread).
    """
    if ready is None:
        return _copy_pieces(entries, coords, staging)
    device, event = ready
    with torch.cuda.device(device):  # the current device is per thread: a background thread starts on 0
        stream = torch.cuda.Stream()
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            out = _copy_pieces(entries, coords, staging)
        stream.synchronize()
    return out


def _copy_pieces(entries: list[Entry], coords: dict[str, int], staging: dict | None) -> list[SavedPiece]:
    out = []
    for entry in entries:
        if not entry.writer or not is_owner(entry.placement, coords):
            continue
        for piece in local_pieces(entry.placement):
            view = local_view(entry.tensor, entry.placement, piece)
            pin = view.device.type == "cuda"
            key = (entry.name, piece.offsets)
            copy = staging.get(key) if staging is not None else None
            if copy is None or tuple(copy.shape) != piece.shape or copy.dtype != view.dtype:
                copy = torch.empty(piece.shape, dtype=view.dtype, device="cpu", pin_memory=pin)
                if staging is not None:
                    staging[key] = copy
            copy.copy_(view.detach(), non_blocking=pin)
            out.append(SavedPiece(entry.name, tuple(entry.placement.global_shape), piece.offsets, copy))
    return out


def saved_bytes(entries: list[Entry], coords: dict[str, int]) -> int:
    """The bytes of the tensors `snapshot` copies for this rank (its file, less the small header)."""
    return sum(math.prod(piece.shape) * entry.tensor.element_size() for entry in entries
               if entry.writer and is_owner(entry.placement, coords) for piece in local_pieces(entry.placement))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomic(path: Path, payload: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank(partial: Path, rank: int, pieces: list[SavedPiece], rng: dict[str, str],
               kill_midway: Callable[[], None] | None = None,
               copy: Callable[[str, str, bytes], None] | None = None) -> None:
    """Write this rank's file and part record into the partial directory. With `copy`, the
    file is serialized in memory, written, and its bytes handed to `copy(name, sha256, bytes)`
    (peer.py: the in-memory copies) before the part record marks the file done."""
    record = {"rank": rank, "file": None, "tensors": [], "rng": rng}
    if pieces:
        name = data_file_name(rank)
        path = partial / name
        tensors = {piece_key(p.name, p.offsets): p.data for p in pieces}
        if kill_midway is not None:  # fault injection: half a file on disk, then the process dies
            blob = save(tensors)
            with open(path, "wb") as f:
                f.write(blob[: len(blob) // 2])
                f.flush()
                os.fsync(f.fileno())
            kill_midway()
        if copy is None:
            try:
                save_file(tensors, str(path), metadata={"format": "pt"})
            except SafetensorError as e:  # its I/O errors as the OSError they are (a full disk, a removed directory)
                number = re.search(r"os error (\d+)", str(e))
                if number is None:
                    raise
                code = int(number.group(1))
                raise OSError(code, os.strerror(code), str(path)) from None
            os.chmod(path, partial.stat().st_mode & 0o666)  # safetensors creates 0600; follow the umask like the rest
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            sha256 = file_sha256(path)
        else:
            blob = save(tensors, metadata={"format": "pt"})  # the same bytes save_file writes
            with open(path, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            sha256 = hashlib.sha256(blob).hexdigest()
            copy(name, sha256, blob)
        record["file"] = {"name": name, "bytes": path.stat().st_size, "sha256": sha256}
        record["tensors"] = [{"name": p.name, "global_shape": list(p.global_shape), "dtype": DTYPE_NAMES[p.data.dtype],
                              "key": piece_key(p.name, p.offsets), "offsets": list(p.offsets),
                              "shape": list(p.data.shape)} for p in pieces]
    _write_json_atomic(partial / f"rank-{rank:05d}.part.json", json.dumps(record))


def wait_for_parts(partial: Path, world_size: int, timeout_s: float) -> list[dict]:
    """Every rank's part record, once all exist (polling: no collective runs off the main thread)."""
    deadline = time.monotonic() + timeout_s
    paths = [partial / f"rank-{r:05d}.part.json" for r in range(world_size)]
    while True:
        if not partial.is_dir():
            raise FileNotFoundError(errno.ENOENT, "removed while the ranks wrote into it", str(partial))
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return [json.loads(p.read_text()) for p in paths]
        if time.monotonic() > deadline:
            raise CheckpointError(f"{partial}: ranks {[paths.index(p) for p in missing]} did not finish writing "
                                  f"within {timeout_s:.0f} s; the checkpoint stays invisible")
        time.sleep(0.02)


def merge_parts(parts: list[dict], step: int, meta: dict) -> Manifest:
    tensors: dict[str, dict] = {}
    files, rng = {}, {}
    for part in parts:
        rank = part["rank"]
        rng[rank] = part["rng"]
        if part["file"] is not None:
            f = part["file"]
            files[f["name"]] = FileInfo(rank, f["bytes"], f["sha256"])
        for t in part["tensors"]:
            info = tensors.setdefault(t["name"], {"shape": tuple(t["global_shape"]), "dtype": t["dtype"], "slices": []})
            if info["shape"] != tuple(t["global_shape"]) or info["dtype"] != t["dtype"]:
                raise CheckpointError(f"ranks disagree on the shape or dtype of {t['name']}")
            info["slices"].append(Slice(part["file"]["name"], t["key"], tuple(t["offsets"]), tuple(t["shape"])))
    return Manifest(step, meta.get("layout", {}),
                    {n: TensorInfo(i["shape"], i["dtype"], tuple(i["slices"])) for n, i in tensors.items()},
                    files, meta.get("data", {}), rng, meta.get("extra", {}), meta.get("config", {}))


def finalize(partial: Path, step: int, world_size: int, meta: dict, keep: int, timeout_s: float) -> Path:
    """Merge the parts into the manifest and make the checkpoint visible; returns its directory."""
    parts = wait_for_parts(partial, world_size, timeout_s)
    manifest = merge_parts(parts, step, meta)
    text = manifest.to_json()
    try:  # the readers' own check, now: a broken placement contract fails the save, not a later resume
        parse_manifest(json.loads(text), str(partial / MANIFEST))
    except CheckpointError as e:
        raise CheckpointError(f"{e}; the ranks' placements do not tile every tensor exactly once (a copy held by "
                              "several ranks must name the axes it is replicated over)") from None
    _write_json_atomic(partial / MANIFEST, text)
    for r in range(world_size):
        (partial / f"rank-{r:05d}.part.json").unlink()
    fsync_dir(partial)
    root = partial.parent
    final = root / step_dir_name(step)
    trash = None
    if final.exists():  # a checkpoint of the same step (e.g. one that failed verification): replace it
        trash = root / f".trash-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
    os.replace(partial, final)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    prune(root, keep, meta.get("config", {}).get("run", {}).get("id", ""))
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Visible checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found)]


def prune(root: Path, keep: int, run_id: str = "") -> None:
    """Keep the newest `keep` checkpoints of run `run_id` (0 keeps all); never touch another run's."""
    if keep > 0:
        for old in [p for p in complete_checkpoints(root) if run_of(p) == run_id][:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def run_of(ckpt: Path) -> str | None:
    """The run id a checkpoint's manifest names ("" for runs without one; None when unreadable)."""
    try:
        run = json.loads((ckpt / MANIFEST).read_text()).get("config", {}).get("run", {})
    except (OSError, ValueError, AttributeError):
        return None
    return str(run.get("id", "")) if isinstance(run, dict) else None


def remove_partials(root: Path) -> None:
    """Leftovers of saves that never completed (a crash mid-write); called before a new save."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.endswith(PARTIAL_SUFFIX) or p.name.startswith(".trash-"):
                shutil.rmtree(p, ignore_errors=True)


class BackgroundWriter:
    """Runs one save job at a time on a daemon thread; `wait()` joins it and re-raises its error,
    `check()` re-raises it once the job has ended (the training loop asks at every step).

    Daemon: if training dies, the process exits without finishing the write, and the partial
    checkpoint stays invisible.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                job()
            except BaseException as e:  # handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="threefold-checkpoint-writer", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Re-raise the error of a job that has ended, without waiting for one still running."""
        if not self.busy():
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
