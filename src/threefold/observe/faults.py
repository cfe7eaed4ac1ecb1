"""Fault injection (config `fault`), so that tests can show what the debugging tools report.

The trainer asks the injector at fixed points of each step; a fault acts only on `fault.rank`,
only in runs of `fault.layout` when one is given (the run's `Layout`, layout.py, with those mesh
sizes), and from the start of `fault.step`:

    raise            RuntimeError at the start of the step
    kill             SIGKILL at the start of the step
    slow             sleep `delay_s` before the computation of this and every later step (a straggler)
    nan              the output of `module` is NaN during this step
    perturb          this step's targets are shifted by one token id (a broken layout, for parity)
    skip_collective  do not join the step's loss all-reduce; stall outside communication instead
                     (the others wait in it until the hang watchdog stops the world)
    lose_node        `fault.rank` is a node (the launcher's --node-rank): its first process SIGKILLs
                     that launcher, and the node's processes die with it; with `fault.hold_file`,
                     every process of a later attempt waits at the start of the step while that
                     file exists (and leaves at once on a stop signal)
    signal           send `fault.signal` (SIGTERM, SIGINT or SIGUSR1) to this process's launcher -
                     threefold's --nproc launcher, which forwards it, else the process itself - and
                     wait until it has reached this process (train/preempt.py), so the world stops
                     at this step; SIGINT,SIGINT sends a second one after that (stop at once)
    signal_rank      the same, sent to `fault.rank` itself only (as srun signals each task)

Faults fire in the first attempt of a job only, except `slow` (a straggler stays one) and the
hold of `lose_node`, which is for the attempts after the loss.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Protocol

from torch import nn

from ..config import FaultConfig
from ..config.debug_checks import fault_applies
from ..data import Batch
from ..errors import ConfigError
from ..launch.nodes import AGENT_PID, NODE_RANK
from ..layout import Layout


class SignalCount(Protocol):
    """How many stop signals this process has received (train/preempt.py StopSignals)."""

    received: int


def first_attempt() -> bool:
    """False in a process the elastic launcher restarted: injected faults fire only once per job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


class FaultInjector:
    def __init__(self, fault: FaultConfig, layout: Layout, rank: int, model: nn.Module, vocab: int,
                 stop: SignalCount | None = None):
        self.fault = fault
        self.stop = stop
        applies = fault_applies(fault, layout)
        self.active = applies and fault.rank == rank and (first_attempt() or fault.kind == "slow")
        if fault.kind == "lose_node":
            self.active = applies and first_attempt() and os.environ.get("LOCAL_RANK") == "0" \
                and os.environ.get(NODE_RANK) == str(fault.rank)
        self.holds = applies and fault.kind == "lose_node" and bool(fault.hold_file) and not first_attempt()
        self.model = model
        self.vocab = vocab
        self._hook = None
        if self.active and fault.kind == "nan" and fault.module not in dict(model.named_modules()):
            raise ConfigError("fault.module", f"no module '{fault.module}' on rank {rank}; use a module name such "
                              "as blocks.0.mlp.up (see models/decoder.py)")

    def _now(self, step: int) -> bool:
        return self.active and step == self.fault.step

    def step_start(self, step: int) -> None:
        """At the very start of the step, before any computation."""
        kind = self.fault.kind
        if self._now(step) and kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self._now(step) and kind == "lose_node":
            launcher = os.getppid()
            os.kill(launcher, signal.SIGKILL)  # this node's processes die with it (launch.die_with_agent)
            while os.getppid() == launcher:  # until the kernel has taken the launcher; then on, if alive
                time.sleep(0.01)
        if self._now(step) and kind in ("signal", "signal_rank"):
            self._signal(kind == "signal" and os.environ.get(AGENT_PID) == str(os.getppid()))
        if self.holds and step == self.fault.step:
            while os.path.exists(self.fault.hold_file):
                if self.stop is not None and self.stop.received:
                    # told to stop while held (the elastic agent ends its workers when the membership
                    # changes): leave at once, as an unhandled SIGTERM would, rather than make the agent
                    # wait out its shutdown timeout for a step boundary this process never reaches
                    os._exit(128 + signal.SIGTERM)
                time.sleep(0.05)
        if self._now(step) and kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.fault.rank} at step {step}")
        if self.active and kind == "slow" and step >= self.fault.step:
            time.sleep(self.fault.delay_s)
        if self._now(step) and kind == "nan":
            module = dict(self.model.named_modules())[self.fault.module]
            self._hook = module.register_forward_hook(lambda m, i, out: out * float("nan"), prepend=True)

    def _signal(self, to_launcher: bool) -> None:
        """Each signal in turn, once the one before has come back (the kernel merges a signal sent
        while the same one is pending); a second SIGINT ends the process, or the launcher ends it."""
        for name in self.fault.signal.split(","):
            received = 0 if self.stop is None else self.stop.received
            os.kill(os.getppid() if to_launcher else os.getpid(), signal.Signals[name.strip()])
            while self.stop is not None and self.stop.received == received:
                time.sleep(0.01)

    def batches(self, step: int, micro_batches: list[Batch]) -> list[Batch]:
        if self._now(step) and self.fault.kind == "perturb":
            return [Batch(mb.inputs, (mb.targets + 1) % self.vocab) for mb in micro_batches]
        return micro_batches

    def skips_collective(self, step: int) -> bool:
        return self._now(step) and self.fault.kind == "skip_collective"

    def stall(self) -> None:
        """Stay away from communication until the watchdog ends the process."""
        while True:
            time.sleep(0.5)

    def step_end(self, step: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

