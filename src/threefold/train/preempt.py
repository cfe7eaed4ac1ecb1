"""Stopping on a signal: save at the next step boundary, exit with a code a requeue script reads.

Slurm and Kubernetes end a job with SIGTERM, Slurm can warn ahead of the time limit
(`#SBATCH --signal=USR1@120`), Ctrl-C is SIGINT. On the first of these a training process
notes the signal (`StopSignals`); the world agrees at the next step boundary through the flag
the step's loss all-reduce already carries (train/trainer.py), saves a checkpoint of that step
(waiting for an async save to be written), prints one line and exits with `PREEMPTED_EXIT`.
A second SIGINT stops at once with `INTERRUPTED_EXIT`, saving nothing more.

Under threefold's launcher (`--nproc`) the workers get the launcher's first signal (its
`Forwarder`, launch/signals.py: the launcher's side, with the signals, exit codes and the note
file); they then exit 0 and note that they stopped early (`stopped_exit_code`), and the launcher
exits with `PREEMPTED_EXIT`. Workers signalled directly (srun signals every task) do the same.
Signals are handled on a thread of their own (launch/signals.py `pumped`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from ..launch.signals import INTERRUPTED_EXIT, NOTE_ENV, PREEMPTED_EXIT, pumped, stop_at_once


class Preempted(Exception):
    """The world stopped on a signal at `step` and saved `checkpoint` (raised by Trainer.run)."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path):
        super().__init__(f"{signal_name} at step {step}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint

    def line(self) -> str:
        return (f"threefold: {self.signal_name} at step {self.step}: saved {self.checkpoint}; exit {PREEMPTED_EXIT} "
                "(preempted) - continue with --resume auto")


class StopSignals:
    """A training process's stop request: the first stop signal it received, if any.

    The trainer reads `first` once per step; `received` counts the signals taken (a test's fault
    waits on it). Without `watching()` nothing arrives: a trainer built in a test never stops.
    """

    def __init__(self):
        self.first: signal.Signals | None = None
        self.received = 0
        self._interrupts = 0
        self._lock = threading.Lock()

    def receive(self, sig: signal.Signals) -> None:
        with self._lock:
            if sig == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    stop_at_once("threefold: SIGINT again: stopped at once, without saving; "
                                 f"exit {INTERRUPTED_EXIT}" if os.environ.get("RANK", "0") == "0" else "")
            if self.first is None:
                self.first = sig
            self.received += 1

    def watching(self):
        """While inside: this process's stop signals come here (main thread only; else none do)."""
        return pumped(self.receive)


def stopped_exit_code(stopped: Preempted) -> int:
    """A worker's exit code after it stopped on a signal and saved: `PREEMPTED_EXIT`, or 0 under
    threefold's launcher (for the elastic agent a non-zero exit is a failure to restart from),
    which then exits with `PREEMPTED_EXIT` after its node's first worker noted the stop here."""
    note = os.environ.get(NOTE_ENV)
    if not note:
        return PREEMPTED_EXIT
    if os.environ.get("LOCAL_RANK", "0") == "0":
        record = {"signal": stopped.signal_name, "step": stopped.step, "checkpoint": str(stopped.checkpoint)}
        Path(note).write_text(json.dumps(record) + "\n")
    return 0
