"""The launcher's side of stopping on a signal: the stop signals, the exit codes, the forwarding.

threefold's launcher (`--nproc`, launch/local.py) passes the first stop signal it gets (SIGTERM,
SIGINT, SIGUSR1) on to its workers (`Forwarder`); its workers then save at the next step boundary
and exit 0, so torch's elastic agent sees a finished job rather than a failure to restart from, and
tell the launcher that they stopped early through a note file (`StopNote`, at `NOTE_ENV`); the
launcher exits with `PREEMPTED_EXIT`. A second SIGINT to the launcher ends its workers (SIGKILL) and
itself at once with `INTERRUPTED_EXIT`. The workers' side is train/preempt.py.

Signals are handled on a thread of their own (`pumped`): Python runs a handler only between
bytecodes of the main thread, and a main thread inside a long collective or kernel would hold
back the second Ctrl-C that is meant to stop it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PREEMPTED_EXIT = 3  # stopped by a signal after saving: resume with --resume auto (docs/checkpoint.md)
INTERRUPTED_EXIT = 130  # a second SIGINT: stopped at once, nothing saved since the newest checkpoint
NOTE_ENV = "THREEFOLD_STOP_NOTE"  # set by the launcher: where its workers note that they stopped early


class Forwarder:
    """threefold's launcher: the first stop signal goes on to the workers (its child processes),
    each once it handles stop signals itself (a worker still starting would die of it); a second
    SIGINT ends them and the launcher at once."""

    def __init__(self):
        self.first: signal.Signals | None = None
        self._interrupts = 0
        self._lock = threading.Lock()
        self._done = threading.Event()

    def receive(self, sig: signal.Signals) -> None:
        with self._lock:
            if sig == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    for pid in _children():
                        _kill(pid, signal.SIGKILL)
                    stop_at_once(f"threefold: SIGINT again: stopped the workers at once, without saving; "
                                 f"exit {INTERRUPTED_EXIT}")
            if self.first is None:
                self.first = sig
                threading.Thread(target=self._forward, args=(sig,), daemon=True, name="threefold-forward").start()

    def _forward(self, sig: signal.Signals) -> None:
        """Until the launch ends: each worker, including those of a later attempt, gets `sig` once."""
        sent: set[int] = set()
        while not self._done.is_set():
            for pid in _children():
                if pid not in sent and _handles_stop_signals(pid):
                    _kill(pid, sig)
                    sent.add(pid)
            self._done.wait(0.1)

    @contextlib.contextmanager
    def watching(self):
        try:
            with pumped(self.receive):
                yield self
        finally:
            self._done.set()


class StopNote:
    """The launcher's side of its workers' note (train/preempt.py `stopped_exit_code`): created before
    the launch, read after it, removed with `close`."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="threefold-stop-")) / "stopped.json"

    def stopped(self) -> bool:
        return self.path.exists()

    def close(self) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)


def stop_at_once(line: str) -> None:
    """Print `line` (unless empty) and end this process now with `INTERRUPTED_EXIT` (a second SIGINT)."""
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(INTERRUPTED_EXIT)


def _note_signal(signum, frame) -> None:
    """The Python-level handler: nothing to do here; the pump thread has the signal already."""


@contextlib.contextmanager
def pumped(on_signal):
    """Deliver this process's STOP_SIGNALS to `on_signal` on a thread of its own, at once.

    Python writes each caught signal's number to the wakeup file descriptor from the C-level
    handler, whatever the main thread is doing; the thread reads them from the pipe. The
    previous handlers and wakeup descriptor come back on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, _note_signal) for sig in STOP_SIGNALS}
    numbers = {int(sig) for sig in STOP_SIGNALS}

    def pump() -> None:
        try:
            while data := os.read(read_fd, 64):
                for number in data:
                    if number in numbers:
                        on_signal(signal.Signals(number))
        finally:
            os.close(read_fd)

    thread = threading.Thread(target=pump, daemon=True, name="threefold-signals")
    thread.start()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # the pump reads the end of the pipe and ends
        thread.join()


def _children() -> list[int]:
    """This process's child processes (Linux: /proc)."""
    pids: list[int] = []
    tasks = Path("/proc/self/task")
    try:
        for task in tasks.iterdir():
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        return pids
    except OSError:
        pass
    me = os.getpid()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me:
                pids.append(int(entry.name))
    return pids


def _handles_stop_signals(pid: int) -> bool:
    """Whether process `pid` catches SIGTERM and SIGUSR1 (a worker that installed StopSignals;
    every Python process catches SIGINT from its start, so SIGINT tells nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            caught = int(line.split()[1], 16)
            return all(caught >> (int(sig) - 1) & 1 for sig in (signal.SIGTERM, signal.SIGUSR1))
    return False


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
