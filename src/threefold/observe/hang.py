"""The hang watchdog: notice a collective that does not finish, dump every rank's flight record,
write one report, and end the processes so the launcher stops the world.

One daemon thread per rank polls `Comm.records` (the flight record) every `poll_s`:

1. A rank whose oldest unfinished collective has been in flight longer than `timeout_s`
   *triggers*: it creates DIR/flight/HANG (exclusively: the first rank to do so is the
   *reporter*) and writes DIR/flight/rank-N.json.
2. Every other rank's watchdog sees HANG at its next poll and writes its own rank-N.json,
   whatever it is doing: waiting in some collective, computing, stalled - the record holds its
   in-flight and last collectives and the Python stack of its main thread (where it is).
3. The reporter waits until every rank's record is there, or `grace_s` passes (a rank that
   crashed or holds the interpreter lock never writes one), then writes DIR/flight/hang-report.json
   and hang-report.txt (observe/hang_report.py: who never joined, what the others wait in).
4. Each rank waits for the report (at most 2 x `grace_s`), prints one line, records the error for
   torch's elastic agent and ends its own process with exit code 1. The launcher prints the
   report (launch/local.py); no process is left behind waiting in a collective.

DIR/flight is the meeting point, so on several nodes DIR must be on a shared filesystem (as
checkpoints already require). Rank 0 empties it before the watchdogs start (`clear_flight_dir`;
an earlier attempt's report is kept as DIR/flight.<unix time>).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from ..comm import Comm
from ..mesh import AXES
from .hang_report import build_report, format_report

MARKER = "HANG"
REPORT_JSON = "hang-report.json"
REPORT_TEXT = "hang-report.txt"


class CollectiveHang(RuntimeError):
    """A collective did not finish within the watchdog's timeout."""


def clear_flight_dir(flight_dir: Path) -> None:
    """Make room for this run's records (call on one rank, then synchronise the world).

    An earlier attempt's hang report (e.g. before the elastic agent restarted the world) is kept
    as DIR/flight.<unix time>; other leftovers are removed.
    """
    flight_dir = Path(flight_dir)
    if (flight_dir / REPORT_JSON).exists():
        flight_dir.rename(flight_dir.with_name(f"{flight_dir.name}.{int(time.time())}"))
    shutil.rmtree(flight_dir, ignore_errors=True)


def in_flight(comm: Comm) -> list:
    """This rank's unfinished collectives, oldest first.

    Unfinished means not *completed*: on NCCL `wait()` returns once the stream waits, so the
    records' completion probes (CUDA events) are polled here; a hung collective stays in flight.
    """
    comm.poll()
    return [r for r in list(comm.records) if r.end is None]  # list(): a snapshot taken under the GIL


def main_thread_stack() -> list[str]:
    """The main thread's Python stack, innermost last, as 'file:line in function' strings."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)]


def snapshot(comm: Comm, step: int, reason: str, tail: int = 32) -> dict:
    """Everything another rank needs to know where this one is."""
    mesh = comm.mesh
    comm.poll()
    now = time.monotonic()
    records = list(comm.records)
    return {
        "rank": mesh.global_rank, "world_size": mesh.world_size, "reason": reason, "step": step,
        "coords": {axis: mesh.rank(axis) for axis in AXES},
        "groups": {axis: list(mesh.ranks(axis)) for axis in AXES},
        "calls_per_axis": dict(comm._axis_seq),
        "in_flight": [dict(r.to_dict(), in_flight_s=now - r.start) for r in records if r.end is None],
        "last_completed": next((r.to_dict() for r in reversed(records) if r.end is not None), None),
        "recent": [r.to_dict() for r in records[-tail:]],
        "stack": main_thread_stack(),
        "monotonic": now, "time": time.time(),
    }


def write_json(path: Path, data: dict) -> None:
    """Atomic: readers see the whole file or none."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of the calling thread (a new thread starts on GPU 0:
    its first CUDA call, the completion events' query, would open a context there on every rank)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class Watchdog:
    def __init__(self, comm: Comm, flight_dir: Path, timeout_s: float, grace_s: float = 10.0,
                 poll_s: float | None = None, step=lambda: 0, exit_process: bool = True):
        self.comm = comm
        self.dir = Path(flight_dir)
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.poll_s = poll_s if poll_s is not None else min(0.5, max(0.05, timeout_s / 20))
        self.step = step  # callable: the step in progress, for the record
        self.exit_process = exit_process  # False in tests of the report itself
        self.fired: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threefold-watchdog", daemon=True)

    @property
    def rank(self) -> int:
        return self.comm.mesh.global_rank

    def start(self) -> "Watchdog":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        bind_device(self.comm.mesh.device)
        marker = self.dir / MARKER
        while not self._stop.wait(self.poll_s):
            stuck = self._stuck()
            if stuck is not None:
                self._fire(f"{stuck.op} on {stuck.axis} (seq {stuck.seq}) in flight for more than "
                           f"{self.timeout_s:g} s", trigger=True)
                return
            if marker.exists():
                self._fire("another rank reported a hang", trigger=False)
                return

    def _stuck(self):
        now = time.monotonic()
        for record in in_flight(self.comm):
            if now - record.start > self.timeout_s:
                return record
        return None

    def _fire(self, reason: str, trigger: bool) -> None:
        reporter = False
        if trigger:
            try:
                fd = os.open(self.dir / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, f"{self.rank}\n".encode())
                os.close(fd)
                reporter = True
            except FileExistsError:
                pass
        self.fired = snapshot(self.comm, self.step(), reason)
        write_json(self.dir / f"rank-{self.rank}.json", self.fired)
        world = self.comm.mesh.world_size
        if reporter:
            self._wait_for(lambda: all((self.dir / f"rank-{r}.json").exists() for r in range(world)), self.grace_s)
            report = build_report(self.dir, world, self.timeout_s)
            write_json(self.dir / REPORT_JSON, report)
            (self.dir / REPORT_TEXT).write_text(format_report(report))
        else:
            self._wait_for(lambda: (self.dir / REPORT_JSON).exists(), 2 * self.grace_s)
        if self.exit_process:
            self._end_process(reason)

    def _wait_for(self, condition, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _end_process(self, reason: str) -> None:
        message = (f"rank {self.rank}: stopped by the hang watchdog: {reason}; "
                   f"report: {self.dir / REPORT_TEXT}")
        print(f"threefold: {message}", file=sys.stderr, flush=True)
        try:  # the elastic agent reads this file to say why the worker failed
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            try:
                raise CollectiveHang(message)
            except CollectiveHang as e:
                ErrorHandler().record_exception(e)
        except Exception:
            pass
        sys.stdout.flush()
        os._exit(1)  # the main thread is blocked in C; only this ends it
