"""`parallel.offload=nvme`: fp32 masters and optimizer moments in a scratch file per rank, streamed.

The optimizer over this rank's pieces (parallel/master.py) with its states outside memory: the
fp32 master of every piece and its moments (AdamW's exp_avg and exp_avg_sq, or SGD's momentum)
live in one file per rank under `parallel.offload_dir`. The concatenation of the pieces is cut
into *units* of at most `parallel.offload_block_mb` of states; a unit's states lie together in
the file, each kind padded to 4096 bytes, so every read and write is one large aligned block
(O_DIRECT where the filesystem takes it, buffered otherwise).

A step streams the units through a bounded pool of `offload_prefetch + 1` host buffers (pinned
next to CUDA): a reader thread reads unit u + prefetch while the host updates unit u with torch's
own multi-tensor kernels (the optimizer entry's `streamed` update, optim/adamw.py and sgd.py: the kernels
`parallel.offload=optimizer` runs on its host pool, multi-threaded where torch's CPU kernels are),
copies the updated masters into the model, and queues the unit's write behind the reads. Those
are elementwise kernels with the step counts and bias corrections of each piece, so cutting
pieces into units gives the bits of the in-memory optimizer (tests/distributed/test_zero.py).

Gradients are what `parallel.offload=optimizer` gives its host pool (fp32, unscaled, one flat
host buffer; the model's own fp32 gradient when there is nothing to convert); the norm and the
clipping act on them through `masters`, one zero-storage holder per piece whose `.grad` is that
gradient (resident: the norm is taken over them before any update). Under ZeRO-3 the parameter
shards live in a scratch file of their own between gathers (`ShardStore`, parallel/shard_store.py):
the step writes each updated unit's shard back there; under ZeRO-1/2 the parameters stay in memory.
Every unit written carries a checksum, verified when it is read back (parallel/scratch.py): bytes the
storage changed stop the run with one line naming the file and the unit, never reach the model.

The file is scratch, not a checkpoint: it is rewritten at every start from the initial values
(or, on a resume, from the checkpoint, which still holds the usual safetensors at any layout),
and removed when the optimizer goes (at the interpreter's exit at the latest). A file left by a
killed process (`threefold-<host>-rank<R>-<pid>.scratch`, its pid gone) is removed at the next
start of that rank on that host: nothing is read from it, the states come from the checkpoint.
`named_state()` reads the states into host tensors for a checkpoint (kept until the next step, so a
load can fill them in place and `after_load` writes them back).

Before the first step the directory is checked: writable, with room for the file's bytes
(`scratch_bytes`); else a ConfigError naming `parallel.offload_dir` and the bytes needed.
"""


from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..optim.registry import entry
from ..sharding import Placement
from .master import Piece, ShardedOptimizer, fp32_grads
from .scratch import (ALIGN, FLOATS, BlockSums, IoStats, ScratchSettings, aligned_buffer, check_scratch, close_scratch,
                      open_scratch, read_block, remove_stale, return_freed_memory, scratch_name, write_block)
from .shard_store import OpenUnit, ShardStore

__all__ = ["ALIGN", "IoStats", "NvmeOptimizer", "ScratchSettings", "ShardStore", "layout_units", "return_freed_memory",
           "scratch_bytes", "scratch_name"]


@dataclass(frozen=True)
class Segment:
    piece: int  # index into the pieces
    lo: int  # element range of the piece
    hi: int
    at: int  # first element inside the unit


@dataclass
class Unit:
    offset: int  # bytes into the file
    numel: int  # elements of states per kind (the sum of the segments)
    padded: int  # numel rounded up to a whole aligned block
    segments: list[Segment] = field(default_factory=list)
    index: int = 0  # its place in the file's units (names it in a checksum error)


def _pad(n: int) -> int:
    return -(-n // FLOATS) * FLOATS


def layout_units(numels: list[int], kinds: int, block_bytes: int) -> list[Unit]:
    """Cut the concatenation of pieces of `numels` elements into units of at most `block_bytes`
    of states (1 + `kinds` fp32 tensors per element), each kind a whole number of aligned blocks."""
    per_unit = max(FLOATS, block_bytes // (4 * (1 + kinds)) // FLOATS * FLOATS)
    units: list[Unit] = []
    current = Unit(0, 0, 0)
    for index, numel in enumerate(numels):
        lo = 0
        while lo < numel:
            take = min(numel - lo, per_unit - current.numel)
            current.segments.append(Segment(index, lo, lo + take, current.numel))
            current.numel += take
            lo += take
            if current.numel == per_unit:
                units.append(current)
                current = Unit(0, 0, 0)
    if current.numel:
        units.append(current)
    offset = 0
    for index, unit in enumerate(units):
        unit.index = index
        unit.padded = _pad(unit.numel)
        unit.offset = offset
        offset += unit.padded * 4 * (1 + kinds)
    return units


def scratch_bytes(numels: list[int], kinds: int, block_mb: float) -> int:
    """Bytes of the scratch file for pieces of `numels` elements with `kinds` moments each."""
    return sum(u.padded * 4 * (1 + kinds) for u in layout_units(numels, kinds, int(block_mb * 2**20)))


class NvmeOptimizer:
    """ShardedOptimizer's face (prepare_grads, step, named_state, ...) over states in a scratch file."""

    offload = True  # the states are not in the compute device's pool

    def __init__(self, pieces: list[Piece], cfg: TrainConfig, settings: ScratchSettings,
                 fp32_init: dict[str, torch.Tensor] | None = None, after_step: Callable[[], None] | None = None,
                 home: ShardStore | None = None, grads: ShardStore | None = None):
        self.update = entry(cfg.optimizer).streamed  # the optimizer registry's update over flat views
        if self.update is None:
            raise ConfigError("parallel.offload", f"train.optimizer={cfg.optimizer} has no streamed update; "
                              "use parallel.offload=optimizer or none, or train.optimizer=adamw/sgd")
        self.pieces = pieces
        self.cfg = cfg
        self.after_step = after_step
        self.home = home  # ZeRO-3: the model's shards in a scratch file of their own (ShardStore)
        self.grads = grads  # ZeRO-3: the reduced gradients in another, streamed (no holder keeps them)
        self._grads_unit = OpenUnit()  # the gradient store's unit being read
        self._inv_scale: float | torch.Tensor = 1.0
        self._norms: list[torch.Tensor] | None = None
        self._clip: torch.Tensor | None = None  # min(1, max_norm / (norm + 1e-6)) for the streamed gradients
        self._home_unit = OpenUnit()  # the home's unit being updated (or read for the first masters)
        self._pre_hooks: list[Callable[[], None]] = []
        self.kinds = entry(cfg.optimizer).states(cfg, True)
        self.placements = [p.placement for p in pieces]
        device = pieces[0].model.device if pieces else torch.device("cpu")
        self.device = device
        self.pin = device.type == "cuda"
        numels = [p.model.numel() for p in pieces]
        self.units = layout_units(numels, len(self.kinds), int(settings.block_mb * 2**20))
        self.nbytes = sum(u.padded * 4 * (1 + len(self.kinds)) for u in self.units)
        directory = Path(settings.directory)
        if directory.is_dir():
            for stale in remove_stale(directory, settings.rank):
                print(f"threefold: removed the stale scratch file {stale} (its process is gone)", file=sys.stderr,
                      flush=True)
        check_scratch(directory, self.nbytes)
        self.path = directory / scratch_name(settings.rank)
        try:
            self.fd, self.direct = open_scratch(self.path)
        except OSError as err:
            raise ConfigError("parallel.offload_dir", f"cannot create {self.path}: {err.strerror}; "
                              "name a writable directory") from None
        self.prefetch = max(0, settings.prefetch)
        self.sums = BlockSums(self.path)  # every unit's checksum, verified on each read
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="threefold-scratch")
        self._finalizer = weakref.finalize(self, close_scratch, self.fd, self.path, self.io)
        largest = max((u.padded for u in self.units), default=FLOATS) * 4 * (1 + len(self.kinds))
        self.buffers = [aligned_buffer(largest, self.pin) for _ in range(min(len(self.units), self.prefetch + 1) or 1)]
        self.stats = IoStats()
        self._lock = threading.Lock()
        # zero-storage holders: the norm and the clipping read and scale their `.grad`
        self.masters = [nn.Parameter(torch.zeros(1).expand(n), requires_grad=False) for n in numels]
        self.aliased = [False] * len(pieces)  # the ShardedOptimizer face: no master shares the model's storage
        self.param_groups = [{"lr": cfg.lr, "weight_decay": cfg.weight_decay, "decay": True},
                             {"lr": cfg.lr, "weight_decay": 0.0, "decay": False}]
        self.steps = 0
        self._loaded: list[dict[str, torch.Tensor]] | None = None  # states read for a checkpoint
        self._write_masters(lambda piece: ShardedOptimizer._initial_values(piece, (fp32_init or {}).get(piece.name)),
                            zero_moments=True)

    # ------------------------------------------------------------ the torch optimizer face

    @property
    def scratch_nbytes(self) -> int:
        """Bytes in the scratch files: the states, and ZeRO-3's parameter shards and gradients (`mem.scratch`)."""
        return self.nbytes + sum(store.nbytes for store in (self.home, self.grads) if store is not None)

    @property
    def state(self) -> dict:
        return {}  # nothing per parameter in memory

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` before each step, and under ZeRO-3 before the shards a checkpoint read leave memory."""
        self._pre_hooks.append(hook)
        if self.home is not None:
            self.home.register_update_pre_hook(hook)

    # ------------------------------------------------------------ scratch I/O (the reader thread)

    def _views(self, buf: torch.Tensor, unit: Unit) -> list[torch.Tensor]:
        """[master, *moments] of `unit` inside `buf` (fp32, padded length)."""
        flat = buf[: unit.padded * 4 * (1 + len(self.kinds))].view(torch.float32)
        return list(flat.view(1 + len(self.kinds), unit.padded).unbind(0))

    def _read(self, unit: Unit, buf: torch.Tensor) -> torch.Tensor:
        """Unit `unit` into `buf`, its checksum verified (a ConfigError when the storage changed it)."""
        start = time.perf_counter()
        n = unit.padded * 4 * (1 + len(self.kinds))
        view = memoryview(buf.numpy())[:n]
        read_block(self.fd, view, unit.offset, self.path)
        summed = time.perf_counter()
        self.sums.check(unit.index, view, unit.offset)
        with self._lock:
            self.stats.sum_s += time.perf_counter() - summed
            self.stats.read_s += time.perf_counter() - start
            self.stats.read_bytes += n
        return buf

    def _write(self, unit: Unit, buf: torch.Tensor) -> None:
        start = time.perf_counter()
        n = unit.padded * 4 * (1 + len(self.kinds))
        view = memoryview(buf.numpy())[:n]
        self.sums.record(unit.index, view)
        summed = time.perf_counter() - start
        write_block(self.fd, view, unit.offset)
        with self._lock:
            self.stats.sum_s += summed
            self.stats.write_s += time.perf_counter() - start
            self.stats.write_bytes += n

    def _stream(self, update: Callable[[Unit, list[torch.Tensor]], bool]) -> None:
        """Every unit through the pool: read ahead by `prefetch`, `update(unit, views)` here, write
        back where it returns True; returns once every write is on the file."""
        nbuf = len(self.buffers)
        depth = min(self.prefetch, nbuf - 1)
        reads: deque[Future] = deque()
        writes: list[Future] = []
        issued = 0
        for u, unit in enumerate(self.units):
            while issued <= min(u + depth, len(self.units) - 1):  # FIFO: after the write that freed its buffer
                reads.append(self.io.submit(self._read, self.units[issued], self.buffers[issued % nbuf]))
                issued += 1
            start = time.perf_counter()
            buf = reads.popleft().result()
            self.stats.wait_s += time.perf_counter() - start
            if update(unit, self._views(buf, unit)):
                writes.append(self.io.submit(self._write, unit, buf))
        for w in writes:
            w.result()

    def _write_all(self, states: list[dict[str, torch.Tensor | None]]) -> None:
        """Write whole-piece states (None: zeros) to the file, unit by unit."""
        buf = self.buffers[0]
        for unit in self.units:
            views = self._views(buf, unit)
            for view in views:
                view[unit.numel:].zero_()
            for seg in unit.segments:
                for view, kind in zip(views, ("master", *self.kinds)):
                    src = states[seg.piece][kind]
                    dst = view[seg.at: seg.at + seg.hi - seg.lo]
                    if src is None:
                        dst.zero_()
                    else:
                        dst.copy_(src.reshape(-1)[seg.lo: seg.hi])
            self._write(unit, buf)

    @torch.no_grad()
    def _write_masters(self, values: Callable[[Piece], torch.Tensor], zero_moments: bool) -> None:
        """Every unit's masters from `values(piece)` (the piece's fp32 values), unit by unit: with ZeRO-3's
        shards in their file each is read while its unit is taken (one unit in memory, not the model);
        the moments zeroed (a start) or read and kept (the model changed under them: checkpoint.init_from)."""
        buf = self.buffers[0]
        current, piece_values = -1, None
        for unit in self.units:
            views = self._views(buf, unit)
            if zero_moments:
                for view in views:
                    view.zero_()
            else:
                self._read(unit, buf)
            for seg in unit.segments:
                piece = self.pieces[seg.piece]
                if seg.piece != current:  # a piece's segments are consecutive: its values made once
                    if self.home is not None:
                        self._home_unit.at(self.home.unit_of[piece.name], self.home.reading)
                    current, piece_values = seg.piece, values(piece).reshape(-1)
                views[0][seg.at: seg.at + seg.hi - seg.lo].copy_(piece_values[seg.lo: seg.hi])
            self._write(unit, buf)
        self._home_unit.at(None)

    def _read_all(self) -> list[dict[str, torch.Tensor]]:
        out = [{kind: torch.empty(p.model.numel(), dtype=torch.float32) for kind in ("master", *self.kinds)}
               for p in self.pieces]

        def gather(unit: Unit, views: list[torch.Tensor]) -> bool:
            for seg in unit.segments:
                for view, kind in zip(views, ("master", *self.kinds)):
                    out[seg.piece][kind][seg.lo: seg.hi].copy_(view[seg.at: seg.at + seg.hi - seg.lo])
            return False

        self._stream(gather)
        return out

    # ------------------------------------------------------------ one step

    def prepare_grads(self, inv_scale: float | torch.Tensor = 1.0) -> tuple[list[nn.Parameter], list[Placement]]:
        """fp32 unscaled gradients on the holders (ShardedOptimizer.prepare_grads with its host pool)."""
        if self.grads is not None:  # streamed: each piece's norm now, its gradient again in the update
            self._inv_scale, self._clip = inv_scale, None
            self._norms = [torch._foreach_norm([self._grad(i)], 2.0)[0] for i in range(len(self.pieces))]
            self._grads_unit.at(None)
            return self.masters, self.placements
        scaled = isinstance(inv_scale, torch.Tensor) or inv_scale != 1.0
        grads = [piece.grad().detach() for piece in self.pieces]
        own = [not scaled and g.dtype == torch.float32 and g.device.type == "cpu" for g in grads]
        for holder, grad in zip(self.masters, fp32_grads(grads, own, torch.device("cpu"), inv_scale)):
            holder.grad = grad
        return self.masters, self.placements

    def grad_norms(self) -> list[torch.Tensor] | None:
        """Streamed gradients: each piece's norm, taken by `prepare_grads` (else None: on the holders)."""
        return self._norms

    def clip(self, params: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
        if self.grads is None:
            ShardedOptimizer.clip(self, params, norm, max_norm)
        elif max_norm > 0:  # torch's clip_grads_with_norm_, applied as each unit's gradients are read
            self._clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    def _grad(self, i: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Piece i's fp32 unscaled gradient [lo, hi) from the store, made by `fp32_grads` (as the in-memory
        path makes it), clipped once `clip` has run: the bits of the in-memory path."""
        piece = self.pieces[i]
        self._grads_unit.at(self.grads.unit_of[piece.name], self.grads.reading)
        # always a copy (own=False): the store's unit is released when the next piece's is read
        grad = fp32_grads([piece.grad().detach()[lo:hi]], [False], torch.device("cpu"), self._inv_scale)[0]
        if self._clip is not None:
            grad.mul_(self._clip.to(grad.device))
        return grad

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Stream every unit: update masters and moments, copy the masters into the model, write back."""
        for hook in self._pre_hooks:
            hook()
        self._loaded = None  # a checkpoint's copy is stale from here on
        if found_inf is not None and bool(found_inf):  # a host read, as on the host pool
            for holder in self.masters:
                holder.grad = None
            return
        start = time.perf_counter()
        self._stream(self._update)
        self._home_unit.at(None)
        if self.grads is not None:
            self._grads_unit.at(None)
            self._norms = self._clip = None
        self.stats.step_s += time.perf_counter() - start
        self.steps += 1
        for holder in self.masters:
            holder.grad = None
        if self.after_step is not None:
            self.after_step()

    def _update(self, unit: Unit, views: list[torch.Tensor]) -> bool:
        master, *moments = views
        for group in self.param_groups:
            segs = [s for s in unit.segments if self.pieces[s.piece].decay == group["decay"]]
            if not segs:
                continue
            params = [master[s.at: s.at + s.hi - s.lo] for s in segs]
            grads = ([self._grad(s.piece, s.lo, s.hi) for s in segs] if self.grads is not None
                     else [self.masters[s.piece].grad[s.lo: s.hi] for s in segs])
            states = [[m[s.at: s.at + s.hi - s.lo] for s in segs] for m in moments]
            self.update(params, grads, states, self.steps, group, self.cfg)
        if self.home is None:
            models = [self.pieces[s.piece].model[s.lo: s.hi] for s in unit.segments]
            torch._foreach_copy_(models, [master[s.at: s.at + s.hi - s.lo] for s in unit.segments])  # blocking:
            return True  # the buffer is reused by a later read
        for s in unit.segments:  # ZeRO-3's shards, unit by unit of the home (the pieces are in its order)
            piece = self.pieces[s.piece]
            self._home_unit.at(self.home.unit_of[piece.name], self.home.updating)
            piece.model[s.lo: s.hi].copy_(master[s.at: s.at + s.hi - s.lo])
        return True

    # ------------------------------------------------------------ memory and checkpoints

    def state_tensors(self) -> list[torch.Tensor]:
        """What is in memory: the states read for a checkpoint, if any (the file holds the rest)."""
        return [t for entry in self._loaded or [] for t in entry.values()]

    def named_state(self) -> list[tuple[Placement, torch.Tensor]]:
        """The states read from the file into host tensors (kept until the next step or `after_load`)."""
        if self._loaded is None:
            self._loaded = self._read_all()
        out = []
        for piece, entry in zip(self.pieces, self._loaded):
            name = piece.placement.name
            for kind in ("master", *self.kinds):
                out.append((replace(piece.placement, name=f"optimizer.{kind}.{name}"), entry[kind]))
        return out

    def step_count(self) -> int:
        return self.steps

    @torch.no_grad()
    def after_load(self, step: int, masters_loaded: bool) -> None:
        """A checkpoint filled the tensors `named_state` gave: model and masters agree, then the file."""
        self.steps = step
        if self._loaded is None:  # nothing was read for it (checkpoint.init_from filled the model): masters from it
            if not masters_loaded:
                self._write_masters(lambda piece: piece.model.detach().float(), zero_moments=False)
            return
        for piece, entry in zip(self.pieces, self._loaded):
            if masters_loaded:
                piece.model.copy_(entry["master"])
            else:
                entry["master"].copy_(piece.model)
        self._write_all(self._loaded)
        self._loaded = None

    @torch.no_grad()
    def load_named_state(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Fill the file from {placement name: local tensor} (as `named_state` names them)."""
        states = []
        for piece in self.pieces:
            name = piece.placement.name
            master = tensors.get(f"optimizer.master.{name}")
            if master is None:
                master = piece.model.detach().float()
            else:
                piece.model.copy_(master)
            states.append({"master": master.cpu(), **{k: tensors[f"optimizer.{k}.{name}"].cpu() for k in self.kinds}})
        self._write_all(states)
        self._loaded = None
        self.steps = step

    def close(self) -> None:
        self._finalizer()
