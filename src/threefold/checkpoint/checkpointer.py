"""The distributed side: every rank saves what it owns, agrees on what to resume, loads its slices.

Collectives (small int64 all-reduces over tp, dp and pp in turn, i.e. over the whole world) run
only on the training thread, at save and resume time: a background writer never communicates,
so it cannot interleave with the training's collectives. Rank 0 learns that the other ranks
finished writing from their part records on the shared file system.

With `peer_copy`, every written file also goes to the in-memory keepers of this node and of a
peer node (peer.py), and a resume reads the files they hold from memory rather than storage.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import Comm
from ..mesh import AXES, EXPERT_AXES, Mesh
from .dcp import is_dcp, load_dcp
from .format import CheckpointError, Manifest, partial_dir_name, read_manifest
from .peer import MemoryFiles, PeerCopies
from .reader import load_entries
from .state import TrainingState, UpdateGuard, capture_rng, restore_rng
from .verify import find_checkpoint_dir, verify_files
from .writer import (BackgroundWriter, complete_checkpoints, finalize, remove_partials, run_of, saved_bytes, snapshot,
                     write_rank)


def free_bytes(path: Path) -> int:
    """Free space on the file system of `path` (tests replace it to simulate a short disk)."""
    return shutil.disk_usage(path).free


def save_failure(step: int, root: Path, error: OSError, keep: int) -> str:
    """The one line for a save that the file system refused."""
    where = f"{error.filename}: " if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"checkpoint: no space left to save step {step} under {root} ({where}{error.strerror}); free space "
                f"on that disk, or lower checkpoint.keep (now {keep}; 0 keeps all) so fewer checkpoints stay")
    if error.errno == errno.ENOENT:
        return (f"checkpoint: {root} was removed while step {step} was saved ({where}{error.strerror}); leave the run "
                "directory in place while the run writes to it (continue with --resume auto)")
    return (f"checkpoint: saving step {step} under {root} failed ({where}{error.strerror or error}); make the run "
            "directory writable, or choose another --out")


class Checkpointer:
    def __init__(self, root: Path, mesh: Mesh, comm: Comm, keep: int = 3, async_save: bool = False,
                 timeout_s: float = 600.0, peer_copy: bool = False):
        self.root = Path(root)
        self.mesh = mesh
        self.comm = comm
        self.keep = keep
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.rank = mesh.global_rank
        self.world_size = mesh.world_size
        self.coords = {axis: mesh.rank(axis) for axis in AXES + EXPERT_AXES}
        self.writer = BackgroundWriter()
        self._staging: dict = {}  # async saves: host buffers reused from save to save
        self._staged = threading.Event()  # set while no snapshot is in flight
        self._staged.set()
        self._guarded = False
        self._guarded_states: list[UpdateGuard] = []  # whose in-place updates wait for the snapshot
        self.last_stall_s = 0.0  # how long the last save() held up training
        self.last_write_s = 0.0  # how long the last save's writing took (in the background when async)
        # checkpoint.peer_copy: the keepers of this world (every rank's node's launcher), and the
        # in-memory files of the checkpoint the resume chose
        self.peers = PeerCopies(self.rank, self._gather_text(PeerCopies.local_address(os.environ))) \
            if peer_copy else None
        self._memory: MemoryFiles | None = None

    def _reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """`t` reduced in place over the whole world (every axis in turn, innermost first; also a barrier)."""
        for axis in reversed(self.mesh.axis_names):
            self.comm.all_reduce(t, axis, op=op, tag="checkpoint")
        return t

    def _agree(self, value: int, op=dist.ReduceOp.MIN) -> int:
        """The reduction of `value` over the whole world (also a barrier)."""
        return int(self._reduce(torch.tensor([value], dtype=torch.int64, device=self.mesh.device), op).item())

    def _gather_text(self, text: str, width: int = 256) -> list[str]:
        """Every rank's `text` (at most `width` bytes), by global rank: a sum of one-row tables."""
        raw = text.encode()[:width]
        t = torch.zeros(self.world_size, width, dtype=torch.int64, device=self.mesh.device)
        t[self.rank, :len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        return [bytes(v for v in row if v).decode(errors="replace") for row in self._reduce(t).cpu().tolist()]

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: TrainingState, meta: dict, kill_midway=None) -> None:
        """Save `state` as checkpoint `step`; `meta` holds the layout, data position and config.

        Synchronous: snapshot and write, visible on every rank on return. Asynchronous: the
        background thread first copies the owned pieces to host memory (the snapshot), then
        writes; training goes on meanwhile, and only the next optimizer step (see `guard`) waits
        for the snapshot, so the copy overlaps the next forward and backward. The next save
        waits for the whole write.
        """
        start = time.perf_counter()
        self.writer.wait()  # one save in flight at a time
        partial = self.root / partial_dir_name(step)
        entries = state.entries()
        need = self._agree(saved_bytes(entries, self.coords), dist.ReduceOp.SUM)  # every rank's file
        short = -1  # rank 0: the free bytes when they stay short of `need` (the save is refused), else -1
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                remove_partials(self.root)
                short = self._make_room(step, need, meta.get("config", {}).get("run", {}).get("id", ""))
                if short < 0:
                    partial.mkdir()
            except OSError as e:
                raise CheckpointError(save_failure(step, self.root, e, self.keep)) from None
        short = self._agree(short, dist.ReduceOp.MAX)  # the partial directory exists before anyone writes into it
        if short >= 0:
            keep = "set checkpoint.keep (now 0: every checkpoint stays) so that old ones make room, " \
                if self.keep == 0 else f"(even without the older checkpoints checkpoint.keep={self.keep} lets go) "
            raise CheckpointError(f"checkpoint: saving step {step} needs about {need / 2**20:.1f} MiB but {self.root} "
                                  f"has {short / 2**20:.1f} MiB free; {keep}free space on that disk, or save "
                                  "elsewhere (--out)")
        if self.async_save and state.rank_state is not None:
            # compression residuals and momenta change in place in the next backward, ZeRO-1/2's
            # parameters in its all-gathers: those updates wait for the snapshot too
            self._guard(state.rank_state)
        rng = capture_rng(self.mesh.device)
        meta = {**meta, "extra": state.extra()}
        # the copy must see every kernel queued so far (the last optimizer step) and nothing later
        ready = None
        if self.mesh.device.type == "cuda":
            ready = (self.mesh.device, torch.cuda.Event())
            ready[1].record()
        staging = self._staging if self.async_save else None
        peers = self.peers
        copy = None if peers is None else (lambda name, sha256, data: peers.send(step, name, sha256, data))
        rank, world_size, keep, timeout_s, staged = self.rank, self.world_size, self.keep, self.timeout_s, self._staged

        def job():
            begin = time.perf_counter()
            try:
                pieces = snapshot(entries, self.coords, staging, ready)
            except Exception as e:
                raise self._failure(step, e) from e
            finally:
                staged.set()
            try:
                write_rank(partial, rank, pieces, rng, kill_midway, copy)
                if rank == 0:
                    finalize(partial, step, world_size, meta, keep, timeout_s)
            except OSError as e:  # a full disk, a directory removed or made read-only meanwhile
                raise CheckpointError(save_failure(step, self.root, e, keep)) from None
            except Exception as e:
                raise self._failure(step, e) from e
            self.last_write_s = time.perf_counter() - begin

        self.last_stall_s = 0.0
        if self.async_save:
            staged.clear()
            self.writer.submit(job)
            if not self._guarded:
                self.wait_staged()
        else:
            job()
            self._agree(0)  # visible to every rank on return
        self.last_stall_s += time.perf_counter() - start

    def _failure(self, step: int, error: Exception) -> Exception:
        """A save's error as one line (a CheckpointError as it is); under async_save it reaches the
        training thread at its next step (`_before_update`), or at the next save or the end."""
        if isinstance(error, CheckpointError) or not self.async_save:
            return error
        text = (str(error).strip().splitlines() or [""])[0]
        return CheckpointError(f"checkpoint: the asynchronous save of step {step} failed ({type(error).__name__}: "
                               f"{text}); step {step} was not saved (its partial directory stays invisible; "
                               "--resume auto takes the last complete checkpoint)")

    def _make_room(self, step: int, need: int, run_id: str) -> int:
        """Rank 0, before a save: when the disk has less than `need` bytes free, remove this run's
        oldest checkpoints that the save's pruning (checkpoint.keep) would remove after it, now,
        but never the last complete one. Returns -1 when the save fits, else the free bytes."""
        free = free_bytes(self.root)
        if free >= need:
            return -1
        mine = [p for p in complete_checkpoints(self.root) if run_of(p) == run_id] if self.keep > 0 else []
        for old in mine[: max(len(mine) - max(self.keep - 1, 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
            free = free_bytes(self.root)
            print(f"threefold: checkpoint: {self.root} had too little space for step {step} (about "
                  f"{need / 2**20:.1f} MiB): removed {old.name} first, which checkpoint.keep={self.keep} "
                  "would remove after the save", file=sys.stderr, flush=True)
            if free >= need:
                return -1
        return free

    def guard(self, optimizer: UpdateGuard) -> None:
        """Make the optimizer's update - what changes the parameters and the states a checkpoint
        saves - wait for the snapshot of an async save in flight. Without it, async saves snapshot at once."""
        self._guard(optimizer)
        self._guarded = True

    def _guard(self, updater: UpdateGuard) -> None:
        if not any(u is updater for u in self._guarded_states):
            updater.register_update_pre_hook(self._before_update)
            self._guarded_states.append(updater)

    def _before_update(self) -> None:
        """Before an in-place update (every step): the snapshot in flight is complete, and the error of
        an async save that has failed meanwhile is raised here, at the step boundary, not at a later save."""
        self.wait_staged()
        self.writer.check()

    def wait_staged(self) -> None:
        """Block until the snapshot of the save in flight is in host memory (counted as stall)."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.last_stall_s += time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; re-raises its error."""
        self.writer.wait()

    def close(self) -> None:
        """End of training: the last checkpoint is complete and visible on every rank."""
        self.wait()
        self._agree(0)

    # ------------------------------------------------------------------ resume

    def find_resume(self, spec: str) -> Path | None:
        """The checkpoint to resume from: `none`, `auto` (newest that verifies) or a path.

        Verification is shared: each rank hashes a share of the files and the verdict is agreed
        over the world. A failing checkpoint is reported (by the rank that found the problem)
        and, under `auto`, skipped for the previous one.
        """
        if spec == "none":
            return None
        if is_dcp(spec):  # a torch.distributed.checkpoint directory: no checksums to verify (dcp.py reads it)
            return Path(spec)
        explicit = spec != "auto"
        candidates = [find_checkpoint_dir(Path(spec))] if explicit else complete_checkpoints(self.root)[::-1]
        for ckpt in candidates:
            problems, shared = self._verify_share(ckpt)
            if self._agree(0 if problems else 1) == 1:
                return ckpt
            if problems and (self.rank == 0 or not shared):
                action = "cannot resume from it" if explicit else "skipping it for an earlier checkpoint"
                print(f"threefold: checkpoint {ckpt} failed verification ({'; '.join(problems)}); {action}",
                      file=sys.stderr, flush=True)
            if explicit:
                raise CheckpointError(f"checkpoint {ckpt} failed verification (the reason is printed above)")
        if self.rank == 0:
            what = "passed verification" if candidates else "exists"
            print(f"threefold: no checkpoint under {self.root} {what}; starting from scratch", file=sys.stderr,
                  flush=True)
        return None

    def _verify_share(self, ckpt: Path) -> tuple[list[str], bool]:
        """(problems found by this rank, whether every rank finds them: manifest-level). Files
        that every rank sees in the keepers' memory are verified when they are read instead."""
        try:
            manifest = read_manifest(ckpt)
        except CheckpointError as e:
            return [str(e)], True
        names = sorted(manifest.files)
        if self.peers is not None:
            self._memory = self._agreed_memory(ckpt, manifest)
            names = [n for n in names if n not in self._memory.where]
        return verify_files(ckpt, manifest, names[self.rank::self.world_size]), False

    def _agreed_memory(self, ckpt: Path, manifest: Manifest) -> MemoryFiles:
        """The files the keepers hold, as every rank sees them (the storage check must not miss one)."""
        memory = self.peers.files_of(ckpt, manifest)
        names = sorted(manifest.files)
        held = torch.tensor([int(n in memory.where) for n in names] or [0], dtype=torch.int64,
                            device=self.mesh.device)
        agreed = {n for n, h in zip(names, self._reduce(held, dist.ReduceOp.MIN).tolist()) if h}
        memory.where = {n: a for n, a in memory.where.items() if n in agreed}
        return memory

    def load(self, ckpt: Path, state: TrainingState) -> Manifest:
        """Fill this rank's parameters, optimizer state, RNG and extra state from `ckpt` (a threefold
        checkpoint, or a torch.distributed.checkpoint directory: dcp.py)."""
        if is_dcp(ckpt):
            return load_dcp(Path(ckpt), state)
        manifest = read_manifest(ckpt)
        memory, self._memory = self._memory, None
        memory = memory if memory is not None and memory.ckpt == Path(ckpt) else None
        load_entries(ckpt, manifest.tensors, state.entries_to_load(manifest), source=memory)
        if memory is not None:
            self._report_sources(Path(ckpt), memory)
        if self.rank in manifest.rng:  # ranks that did not exist when it was written keep the seeded RNG
            restore_rng(manifest.rng[self.rank], self.mesh.device)
        state.load_extra(manifest.extra)
        return manifest

    def _report_sources(self, ckpt: Path, memory: MemoryFiles) -> None:
        """Rank 0 says where the files came from and, when an in-memory copy could not be used,
        gives one warning line for the world (the first such file of the lowest rank that had one)."""
        counts = torch.tensor([memory.from_memory, memory.from_storage, len(memory.fallbacks)], dtype=torch.int64,
                              device=self.mesh.device)
        from_memory, from_storage, fallbacks = self._reduce(counts).tolist()
        reasons = [r for r in self._gather_text(memory.fallbacks[0] if memory.fallbacks else "") if r] \
            if fallbacks else []
        if self.rank == 0 and reasons:
            more = f" (and {fallbacks - 1} more)" if fallbacks > 1 else ""
            print(f"threefold: warning: checkpoint.peer_copy: the in-memory copy of {reasons[0]}{more}; "
                  "read from storage instead", file=sys.stderr, flush=True)
        if self.rank == 0:
            print(f"threefold: loaded {ckpt.name}: {from_memory} file reads from peer memory, {from_storage} from "
                  "storage", file=sys.stderr, flush=True)
