"""The scratch files of `parallel.offload=nvme` (parallel/nvme.py, parallel/shard_store.py): their
directory's checks, names, stale-file removal, aligned host buffers, and the checksum every block
carries.

Every block written to a scratch file has its CRC-32 (`zlib.crc32`) kept in memory (`BlockSums`),
and every read of that block is checked against it before its bytes are used: a block the storage
gave back changed (a bad disk, a file overwritten by something else) stops the run with one line
naming the file and the block (a ConfigError on `parallel.offload_dir`), never trains on it. The
sums are taken on the scratch I/O threads, next to the reads and writes they check.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

ALIGN = 4096  # bytes: every block's offset and length (O_DIRECT's granularity on common filesystems)
FLOATS = ALIGN // 4


@dataclass(frozen=True)
class ScratchSettings:
    directory: Path
    prefetch: int = 2  # units read ahead of the one being updated
    block_mb: float = 64.0  # bytes of states per unit (all kinds together)
    rank: int = 0  # the global rank: names the file


@dataclass
class IoStats:
    """Seconds and bytes of the scratch traffic since the last `reset()`."""
    read_s: float = 0.0  # time the reader spent in reads
    write_s: float = 0.0
    wait_s: float = 0.0  # time the step waited for a read to complete
    step_s: float = 0.0  # time in the streamed update
    sum_s: float = 0.0  # time in the blocks' checksums (taken and checked, inside read_s and write_s)
    read_bytes: int = 0
    write_bytes: int = 0

    def reset(self) -> None:
        self.read_s = self.write_s = self.wait_s = self.step_s = self.sum_s = 0.0
        self.read_bytes = self.write_bytes = 0


class BlockSums:
    """The checksum of every block written to one scratch file, kept in memory by block index, and the
    check of each read against it (`zlib.adler32`: about 3x faster than crc32 here, and a changed
    block goes unnoticed only by a 32-bit coincidence). `checked` counts the blocks verified."""

    def __init__(self, path: Path, block: str = "unit"):
        self.path = path
        self.block = block  # what a block is called in the error (an optimizer unit, a shard unit)
        self.sums: dict[int, int] = {}
        self.checked = 0

    def record(self, index: int, data: memoryview) -> None:
        self.sums[index] = zlib.adler32(data)

    def check(self, index: int, data: memoryview, offset: int) -> None:
        """ConfigError (parallel.offload_dir, one line) when `data`, just read, is not what was written."""
        self.checked += 1
        if self.sums.get(index) != zlib.adler32(data):
            raise ConfigError("parallel.offload_dir", f"{self.path}: {self.block} {index} (bytes {offset}-"
                              f"{offset + len(data) - 1}) read back other bytes than were written: the scratch "
                              "storage corrupted data; check that disk or name another directory, then continue "
                              "with --resume auto")


def read_block(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` from the file at `offset` (an OSError on a short read)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read of {path} at {offset + done}")
        done += got


def write_block(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


def check_scratch(directory: Path, needed: int) -> None:
    """The directory exists, takes a file, and has `needed` bytes free (ConfigError otherwise)."""
    key = "parallel.offload_dir"
    if not directory.is_dir():
        raise ConfigError(key, f"{directory} is not a directory; create it or name another one")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ConfigError(key, f"{directory} is not writable ({err.strerror}); name a directory this user can "
                          "write") from None
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ConfigError(key, f"{directory} has {free} bytes free, the optimizer states need {needed} bytes "
                          f"({needed / 2**30:.2f} GiB); free space there or name another filesystem")


MMAP_THRESHOLD = 1 << 18  # bytes: host allocations at least this large are mapped, and unmapped when freed


def return_freed_memory() -> bool:
    """Have glibc's malloc give freed blocks of `MMAP_THRESHOLD` bytes and more back to the system.

    By default glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    so once a unit's buffers were freed the next ones come from the heap, which keeps what is freed:
    a run streaming its states would hold the gathered units and gradients of a whole pass resident
    (measured: 400 MB for a 160M-parameter model, 50 units of 13 MB). A fixed threshold (`mallopt`,
    which also stops the dynamic adjustment) returns them. A setting of the process; False where the
    C library is not glibc (nothing is changed)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start: start + nbytes]


def open_scratch(path: Path) -> tuple[int, bool]:
    """The file opened for reads and writes, with O_DIRECT where the filesystem accepts it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, flags | direct, 0o600)
        except OSError:
            pass
        else:
            probe = aligned_buffer(ALIGN, False)
            try:
                os.pwrite(fd, memoryview(probe.numpy()), 0)
                return fd, True
            except OSError:
                os.close(fd)
    return os.open(path, flags, 0o600), False


def scratch_name(rank: int, pid: int | None = None) -> str:
    """The scratch file's name: host, global rank and the owning process (stale files are found by it)."""
    return f"threefold-{socket.gethostname()}-rank{rank}-{os.getpid() if pid is None else pid}.scratch"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(directory: Path, rank: int) -> list[Path]:
    """Remove this host's scratch files of `rank` whose process is gone (a killed run: SIGKILL, a crash
    of the machine); their contents are never read, a start rebuilds the states from the checkpoint
    or the initial values. Files of live processes, and of other hosts sharing the directory, stay."""
    prefix = scratch_name(rank, 0)[: -len("0.scratch")]
    removed = []
    for path in directory.glob(f"{prefix}*.scratch"):
        pid = path.name[len(prefix): -len(".scratch")].split("-")[0]  # <pid>.scratch or <pid>-params.scratch
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def close_scratch(fd: int, path: Path, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
    path.unlink(missing_ok=True)
