"""The trainer's one handle on the debugging tools, switched on by config `debug` (docs/observe.md).

    start()            before the first step: hang watchdog (after rank 0 empties DIR/flight)
    step_begin(step)   clocks, non-finite flags
    step_end(...)      per-rank statistics and non-finite report (one all-gather), trace, replica
                       hash check, collective fingerprint; returns fields for the step's record
    finish()           after the last step: DIR/observe/summary.json, traces, parameter dump
    stop()             always: watchdog and hooks off
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from ..comm import Comm
from ..config import Config
from ..mesh import Mesh
from .fingerprint import Fingerprint
from .hang import Watchdog, clear_flight_dir
from .nonfinite import NonFiniteMonitor, decode_name, encode_name
from .params import dump_owned
from .replicas import check_replicas, replicated_params
from .stats import RunStats, blocked_seconds, gather_world, split_step, straggler
from .trace import TraceRecorder, merge_traces


def watchdog_timeout_s(cfg: Config) -> float:
    return cfg.debug.hang_timeout_s or cfg.run.collective_timeout_s


def process_group_timeout_s(cfg: Config) -> float:
    """torch's own collective timeout: a backstop set after the watchdog has had time to report."""
    if not cfg.debug.watchdog:
        return cfg.run.collective_timeout_s
    return max(cfg.run.collective_timeout_s, watchdog_timeout_s(cfg) + 3 * cfg.debug.hang_grace_s + 30.0)


def world_barrier(comm: Comm) -> None:
    """Every rank has arrived: barriers over every axis, innermost first, compose to one over the world."""
    for axis in reversed(comm.mesh.axis_names):
        comm.barrier(axis)


class Observer:
    def __init__(self, cfg: Config, mesh: Mesh, comm: Comm, parallel, out: Path):
        self.cfg, self.mesh, self.comm, self.parallel, self.out = cfg, mesh, comm, parallel, Path(out)
        d = cfg.debug
        self.rank = mesh.global_rank
        self.is_writer = self.rank == 0
        self.step = 0
        self.nonfinite = NonFiniteMonitor(parallel.module) if d.nan_check else None
        self.fingerprint = Fingerprint(comm) if d.fingerprint_every else None
        label = " ".join(f"{a}={mesh.rank(a)}" for a in mesh.axis_names)
        self.trace = TraceRecorder(self.rank, label) if d.trace else None
        self.gathering = d.stats or d.nan_check
        self.run_stats = RunStats(d.straggler_ratio)
        self.nonfinite_events: list[dict] = []
        self.replica_checks = 0
        self.watchdog: Watchdog | None = None
        self._t0 = 0.0
        self._seq0 = 0

    # ------------------------------------------------------------ run boundaries

    def start(self) -> None:
        d = self.cfg.debug
        if d.watchdog and self.mesh.world_size > 1:
            flight = self.out / "flight"
            if self.is_writer:
                clear_flight_dir(flight)
            world_barrier(self.comm)  # nobody watches DIR/flight before it is empty
            self.watchdog = Watchdog(self.comm, flight, watchdog_timeout_s(self.cfg), d.hang_grace_s,
                                     step=lambda: self.step).start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.nonfinite is not None:
            self.nonfinite.close()
        if self.fingerprint is not None:
            self.fingerprint.close()

    def finish(self) -> None:
        """After the last step, on every rank (collective: a barrier when traces are merged)."""
        d = self.cfg.debug
        if d.dump_params:
            dump_owned(self.parallel.module.named_parameters(), self.parallel.placements, self.mesh,
                       self.out / "params")
        if self.trace is not None:
            trace_dir = self.out / "trace"
            self.trace.write(trace_dir / f"rank-{self.rank}.json")
            world_barrier(self.comm)
            if self.is_writer:
                merge_traces([trace_dir / f"rank-{r}.json" for r in range(self.mesh.world_size)],
                             trace_dir / "all.json")
        if self.is_writer and (self.gathering or d.replica_check_every or d.fingerprint_every):
            self._write("summary.json", self.summary())
            verdict = self.run_stats.summary()
            if verdict.get("straggler") is not None:
                r = verdict["straggler"]
                med = verdict["median_per_rank"]["compute_s"]
                others = sorted(med)[len(med) // 2]
                print(f"threefold: straggler: rank {r} computes {med[r]:.3f} s per step against a median of "
                      f"{others:.3f} s (per-rank split in {self.out / 'observe' / 'summary.json'})",
                      file=sys.stderr, flush=True)

    def summary(self) -> dict:
        return {"stats": self.run_stats.summary(), "nonfinite": self.nonfinite_events,
                "replica_checks": self.replica_checks,
                "fingerprint_checks": self.fingerprint.checks if self.fingerprint else 0}

    # ------------------------------------------------------------ steps

    @property
    def checks_each_step(self) -> bool:
        """Whether step_end works on the step's own figures and state (the trainer then reads each
        step before launching the next)."""
        d = self.cfg.debug
        return bool(self.gathering or self.trace is not None or d.replica_check_every or d.fingerprint_every)

    def step_begin(self, step: int) -> None:
        self.step = step
        self._t0 = time.monotonic()
        self._seq0 = self.comm._seq
        if self.nonfinite is not None:
            self.nonfinite.reset()

    def step_end(self, step: int, loss_sum: torch.Tensor, grad_norm: float, local_tokens: int) -> dict:
        """Per-step checks; returns extra fields for the step's metrics record."""
        d = self.cfg.debug
        t1 = time.monotonic()
        extra = {}
        if self.trace is not None:
            self.trace.add_step(step, self._t0, t1, self._step_records())
        if self.gathering:
            extra.update(self._gather(step, t1 - self._t0, loss_sum, grad_norm, local_tokens))
        if d.replica_check_every and step % d.replica_check_every == 0:
            self.parallel.settle()
            named = [(self.parallel.placements[n].name, p) for n, p in
                     replicated_params(self.parallel.module.named_parameters(), self.parallel.placements,
                                       self.mesh.replica_axis)]
            check_replicas(self.comm, named, step, self.mesh.replica_axis)
            self.replica_checks += 1
        if self.fingerprint is not None and step % d.fingerprint_every == 0:
            self.fingerprint.check(step)
        return extra

    def _step_records(self) -> list:
        out = []
        for record in reversed(self.comm.records):
            if record.seq <= self._seq0:
                break
            out.append(record)
        return out[::-1]

    def _gather(self, step: int, step_s: float, loss_sum: torch.Tensor, grad_norm: float, local_tokens: int) -> dict:
        position = self.nonfinite.first_position() if self.nonfinite is not None else None
        first_bad = self.nonfinite.first() if position is not None else None
        self.comm.poll()  # completions seen since (CUDA: events that passed)
        blocked = blocked_seconds(self.comm.records, self._seq0)
        loss = float(loss_sum) / max(1, local_tokens)
        # a non-finite output is ordered by (pipeline stage, position in this rank's forward):
        # activations flow from earlier stages and positions to later ones, never back in a forward
        order = -1.0 if position is None else float(self.mesh.rank("pp") * 2**32 + position)
        row = torch.tensor([step_s, blocked, loss, grad_norm, order],
                           dtype=torch.float64, device=self.mesh.device)
        table = gather_world(self.comm, row).cpu().tolist()
        split = split_step([r[0] for r in table], [r[1] for r in table])
        flagged = straggler(split["compute_s"], self.cfg.debug.straggler_ratio)
        self.run_stats.add(split, flagged)
        extra = {"ranks": {**{k: v for k, v in split.items() if k != "step_s"},
                           "loss": [r[2] for r in table], "grad_norm": [r[3] for r in table]},
                 "straggler": flagged}
        bad_loss = [i for i, r in enumerate(table) if not math.isfinite(r[2])]
        flagged_modules = sorted((i for i, r in enumerate(table) if r[4] >= 0), key=lambda i: (table[i][4], i))
        if flagged_modules or bad_loss:
            extra["nonfinite"] = self._nonfinite_event(step, first_bad, flagged_modules, bad_loss)
        return extra

    def _nonfinite_event(self, step: int, first_bad: str | None, flagged: list[int], bad_loss: list[int]) -> dict:
        event = {"step": step, "ranks": flagged or bad_loss, "modules": {}}
        if flagged:  # a second all-gather, only in the step where it happens: the module names
            names = gather_world(self.comm, encode_name(first_bad or "").to(self.mesh.device), tag="nonfinite")
            event["modules"] = {str(r): decode_name(names[r].cpu()) for r in flagged}
            event["first"] = {"rank": flagged[0], "module": event["modules"][str(flagged[0])]}
            where = f"rank {flagged[0]} in module {event['first']['module']}"
            if len(flagged) > 1:
                where += "; then " + ", ".join(f"rank {r} in {event['modules'][str(r)]}" for r in flagged[1:])
        else:
            where = (f"rank{'s' if len(bad_loss) > 1 else ''} {','.join(map(str, bad_loss))} (loss; "
                     "set debug.nan_check=true to name the module)")
        event["message"] = f"non-finite values at step {step}: first on {where} (forward output)"
        if not self.nonfinite_events and self.is_writer:
            self._write("nonfinite.json", event)
            print(f"threefold: {event['message']}", file=sys.stderr, flush=True)
        if len(self.nonfinite_events) < 100:
            self.nonfinite_events.append(event)
        return event

    def _write(self, name: str, data: dict) -> None:
        path = self.out / "observe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
