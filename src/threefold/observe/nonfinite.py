"""NaN / Inf detection that names the first module whose output went non-finite.

A forward hook on every module of this rank's model records, without synchronising, whether
the module's floating-point output is all finite (`torch.isfinite(out).all()`, a 0-dim tensor).
Hooks fire when a module *finishes*, so the order of the flags is execution order with children
before their parents: the first non-finite flag belongs to the innermost module that produced
the first non-finite value (everything after it only inherits it). `first()` synchronises once
per step. The trainer all-gathers the verdicts so that one report names the rank(s) and module;
`first_position()` (how many module outputs this rank produced before the bad one) orders ranks
that run the same modules, e.g. a tensor-parallel partner that received the NaN through a
collective comes after the rank that produced it.

`poisoned(record)`: a step whose loss or gradient norm is not finite is not saved (train/trainer.py);
the reason names the origin as the report above does.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn


class NonFiniteMonitor:
    def __init__(self, model: nn.Module):
        self._flags: list[torch.Tensor] = []
        self._names: list[str] = []
        self._handles = [module.register_forward_hook(self._hook(name or "model"))
                         for name, module in model.named_modules()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            for tensor in _tensors(output):
                if tensor.is_floating_point():
                    self._flags.append(torch.isfinite(tensor).all())
                    self._names.append(name)
        return hook

    def reset(self) -> None:
        self._flags.clear()
        self._names.clear()

    def first(self) -> str | None:
        """The module whose output was the first non-finite one since `reset()`, or None."""
        position = self.first_position()
        return None if position is None else self._names[position]

    def first_position(self) -> int | None:
        """Index of the first non-finite output since `reset()` in execution order, or None."""
        if not self._flags:
            return None
        finite = torch.stack(self._flags)
        if bool(finite.all()):
            return None
        return int((~finite).nonzero()[0])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def encode_name(name: str, width: int = 256) -> torch.Tensor:
    """A module name as a fixed-width uint8 row, to all-gather names as tensors."""
    raw = name.encode()[:width]
    row = torch.zeros(width, dtype=torch.uint8)
    row[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return row


def decode_name(row: torch.Tensor) -> str:
    return bytes(int(b) for b in row.tolist() if b).decode(errors="replace")


def poisoned(record: dict) -> str | None:
    """Why a step's state must not be saved: its loss or gradient norm (the host numbers its metrics
    record already holds: no extra read of the device) is not finite, with the origin the non-finite
    report found (`Observer`, debug.nan_check / debug.stats), or None for a finite step."""
    bad = [f"{key} {record[key]}" for key in ("loss", "grad_norm")
           if record.get(key) is not None and not math.isfinite(record[key])]
    if not bad:
        return None
    event = record.get("nonfinite")
    if event and event.get("first"):
        origin = f"first on rank {event['first']['rank']} in module {event['first']['module']}"
    elif event and event.get("ranks"):
        origin = f"first on rank(s) {','.join(map(str, event['ranks']))} (loss)"
    else:
        origin = "origin not traced: set debug.nan_check=true to name the module"
    return f"non-finite {' and '.join(bad)} ({origin})"


class PoisonedSaves:
    """The trainer's saves refused on non-finite steps. `refuses(record, newest)` before every save
    (the step's due save, the final one, a preemption's): a poisoned step (`poisoned`) is not saved,
    one line (rank 0) names the step, the origin and the newest checkpoint, which stays the newest;
    `owed` then makes the next finite step save (the trainer clears it when it saves)."""

    def __init__(self, announce: bool):
        self.announce = announce
        self.owed = False
        self.last_refused = -1  # the step whose save was refused last (its line is printed once)

    def refuses(self, record: dict, newest: str) -> bool:
        reason = poisoned(record)
        if reason is None:
            return False
        self.owed = True
        if self.announce and record["step"] != self.last_refused:
            print(f"threefold: step {record['step']} not saved: {reason}; the newest checkpoint stays {newest}",
                  file=sys.stderr, flush=True)
        self.last_refused = record["step"]
        return True
