"""ZeRO-3's parameter shards and reduced gradients in scratch files of their own (`ShardStore`), and
`OpenUnit`, one unit of a store held open while consecutive pieces use it (parallel/nvme.py)."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from .scratch import (ALIGN, BlockSums, IoStats, ScratchSettings, check_scratch, close_scratch, read_block,
                      remove_stale, scratch_name, write_block)


class OpenUnit:
    """One unit of a ShardStore held open through one of its context managers (`updating`, `reading`)
    while consecutive pieces use it; opening another closes the one before (written back by `updating`)."""

    def __init__(self):
        self.index: int | None = None
        self._ctx: contextlib.AbstractContextManager | None = None

    def at(self, index: int | None, opener: Callable[[int], contextlib.AbstractContextManager] | None = None) -> None:
        """Have unit `index` open through `opener(index)`; None: close the open one."""
        if index == self.index:
            return
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
        self.index = index
        if index is not None:
            self._ctx = opener(index)
            self._ctx.__enter__()


class ShardStore:
    """ZeRO-3's parameter shards (each unit's flat shard buffer, parallel/zero3.py) in a scratch file.

    Every unit's shard has a region of its own (aligned to 4096 bytes) in
    `threefold-<host>-rank<R>-<pid>-params.scratch`. Between uses the shard's storage is resized to
    zero (the views `named_parameters()` lists keep their identity); `load(i)` gives it storage back
    and reads it - normally already read ahead: each load starts the read of the unit after it in
    the direction of travel (forward up, backward down), so at most one shard is in flight beyond
    the ones in use - and `drop(i)` releases it once its gather has completed. The optimizer step
    takes each unit with `updating(i)`: read, the masters copied in, written back, released.

    The file is unlinked as soon as it is open: the kernel frees its blocks when the descriptor
    closes, whatever ends the process, so it never goes stale.

    Each shard is written to the file as the build makes it (`add`) and released, so no more than one
    unit's shard is in memory from the build on. After `settle()` (a checkpoint reads or fills the
    shards in place, a reader outside a pass asks for them) every shard is resident; the next pass
    writes them all back and releases them. Reads and writes are buffered (the shard
    buffers are the model's own allocations, not aligned blocks)."""

    def __init__(self, settings: ScratchSettings, kind: str = "params"):
        directory = Path(settings.directory)
        if directory.is_dir():
            remove_stale(directory, settings.rank)
        check_scratch(directory, 0)
        self.path = directory / scratch_name(settings.rank).replace(".scratch", f"-{kind}.scratch")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as err:
            raise ConfigError("parallel.offload_dir", f"cannot create {self.path}: {err.strerror}; "
                              "name a writable directory") from None
        # unlinked at once: the blocks live while the descriptor does, so no crash or kill leaves the file
        # behind (the hooks ZeRO-3 puts on its parameters keep it alive until its process ends)
        self.path.unlink()
        self.sums = BlockSums(self.path, f"{kind} unit")  # every shard's checksum, verified on each read
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="threefold-shards")
        self._finalizer = weakref.finalize(self, close_scratch, self.fd, self.path, self.io)
        self.shards: list[torch.Tensor] = []  # each unit's flat shard buffer
        self.offsets: list[int] = []
        self.unit_of: dict[str, int] = {}  # local parameter name -> unit index
        self.nbytes = 0
        self.resident: set[int] = set()
        self.pending: dict[int, Future] = {}  # reads in flight
        self.pinned = False  # every shard resident (after settle, until the next pass)
        self.last = -1  # the unit loaded last: the direction of the read-ahead
        self.stats = IoStats()
        self.peak_resident = 0  # the most shards in memory or being read at once outside the pinned state
        self._pre_hooks: list[Callable[[], Callable[[], None] | None]] = []  # weak: before settled shards go

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before the shards that `settle()` made resident are written back and released (an
        UpdateGuard, checkpoint/state.py: an async save's snapshot reads them on another thread). Held weakly
        when a bound method: ZeRO-3's parameter hooks keep the store to the process's end, and a checkpointer
        it held would keep the optimizer and its scratch file with it."""
        self._pre_hooks.append(weakref.WeakMethod(hook) if inspect.ismethod(hook) else (lambda: hook))

    def file_bytes(self) -> int:
        """The bytes the (unlinked) file holds on its filesystem."""
        return os.fstat(self.fd).st_size

    def add(self, index: int, shard: torch.Tensor, names: list[str]) -> None:
        """Register unit `index`'s flat shard buffer (resident now, holding its values) and its parameters'
        names; the values go to the file and the storage is released at once (the build holds one unit)."""
        assert index == len(self.shards)
        self.shards.append(shard)
        self.offsets.append(self.nbytes)
        self.nbytes += -(-shard.numel() * shard.element_size() // ALIGN) * ALIGN
        for name in names:
            self.unit_of[name] = index
        if shard.numel():
            self._write(index)
        self._release(index)

    def _bytes(self, index: int) -> memoryview:
        """The shard's bytes (not through numpy: a storage numpy has seen can no longer be resized)."""
        shard = self.shards[index]
        nbytes = shard.numel() * shard.element_size()
        return memoryview((ctypes.c_ubyte * nbytes).from_address(shard.data_ptr())).cast("B")

    def _read(self, index: int) -> None:
        start = time.perf_counter()
        view = self._bytes(index)
        read_block(self.fd, view, self.offsets[index], self.path)
        summed = time.perf_counter()
        self.sums.check(index, view, self.offsets[index])
        self.stats.sum_s += time.perf_counter() - summed
        self.stats.read_s += time.perf_counter() - start
        self.stats.read_bytes += len(view)

    def _write(self, index: int) -> None:
        start = time.perf_counter()
        view = self._bytes(index)
        self.sums.record(index, view)
        self.stats.sum_s += time.perf_counter() - start
        write_block(self.fd, view, self.offsets[index])
        self.stats.write_s += time.perf_counter() - start
        self.stats.write_bytes += len(view)

    def _start_read(self, index: int) -> None:
        if index in self.resident or index in self.pending or not 0 <= index < len(self.shards):
            return
        shard = self.shards[index]
        if shard.numel() == 0:
            return
        shard.untyped_storage().resize_(shard.numel() * shard.element_size())
        self.pending[index] = self.io.submit(self._read, index)

    def load(self, index: int) -> None:
        """Unit `index`'s shard in memory (waiting for its read), and the next one's read started."""
        ahead = index + (1 if index >= self.last else -1)
        self.last = index
        if index not in self.resident and self.shards[index].numel():
            self._start_read(index)
            start = time.perf_counter()
            self.pending.pop(index).result()
            self.stats.wait_s += time.perf_counter() - start
            self.resident.add(index)
        for other in [i for i in self.pending if i != ahead]:  # a read ahead the other way: not needed now
            self.pending.pop(other).result()
            self._release(other)
        self._start_read(ahead)
        if not self.pinned:
            self.peak_resident = max(self.peak_resident, len(self.resident) + len(self.pending))

    def _release(self, index: int) -> None:
        self.resident.discard(index)
        self.shards[index].untyped_storage().resize_(0)

    def drop(self, index: int) -> None:
        """Release unit `index`'s shard (its gather has completed); kept while pinned."""
        if not self.pinned and index in self.resident:
            self._release(index)

    @contextlib.contextmanager
    def updating(self, index: int):
        """The shard resident for the optimizer to write into, then written back and released."""
        with self.reading(index) as shard:
            yield shard
            self._write(index)

    @contextlib.contextmanager
    def reading(self, index: int):
        """The shard resident to be read, then released (kept while pinned); nothing is written."""
        self.load(index)
        yield self.shards[index]
        self.drop(index)

    @torch.no_grad()
    def accumulate(self, index: int, values: torch.Tensor, fresh: bool) -> None:
        """shard += values (fresh: the shard is zeros, nothing read), written back and released (a gradient
        store: each micro-batch's reduced chunk added to what the earlier ones left in the file)."""
        shard = self.shards[index]
        if fresh:
            if index in self.pending:
                self.pending.pop(index).result()
            shard.untyped_storage().resize_(shard.numel() * shard.element_size())
            self.resident.add(index)
            shard.zero_()
        else:
            self.load(index)
        shard.add_(values)
        self._write(index)
        self.drop(index)

    def settle(self) -> None:
        """Every shard resident until the next pass (checkpoints, evaluations, the end of a run)."""
        self.pinned = True
        for index in range(len(self.shards)):
            self.load(index)
        for index in list(self.pending):
            self.pending.pop(index).result()
            self.resident.add(index)
        self.pinned = True

    def begin_pass(self) -> None:
        """Leave the pinned state: every shard written to the file (a load may have filled it), released."""
        if not self.pinned:
            return
        for ref in self._pre_hooks:
            hook = ref()
            if hook is not None:
                hook()
        for index in range(len(self.shards)):
            if index in self.pending:
                self.pending.pop(index).result()
                self.resident.add(index)
            if index in self.resident:
                self._write(index)
                self._release(index)
        self.pinned = False
        self.last = -1

    def close(self) -> None:
        self._finalizer()
