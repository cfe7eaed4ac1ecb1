"""`Comm` under torch.compile: every collective and every wait runs eagerly, outside the graph.

Comm's bookkeeping (byte accounting, the flight record with its call site and clock, the
asynchronous Work handles) is plain Python that dynamo cannot capture into a graph: traced
into, it breaks at several places per collective and recompiles on every new counter value.
`keep_collectives_eager()` marks the collectives, `Handle.wait` and `Handle.is_completed` with
`torch.compiler.disable`, so each call inside a compiled region is exactly one graph break:
dynamo ends the graph before it, runs the call eagerly (every byte counted and recorded as
without compile) and compiles the code after it as the next graph.

It is called by `train.compile` only (parallel/compile.py), once per process: importing dynamo
costs seconds, which runs without compile do not pay.
"""

from __future__ import annotations

import torch

from .collectives import Comm, Handle

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_many", "broadcast", "reduce",
               "all_to_all", "all_to_all_v", "barrier", "send", "recv", "batch_send_recv", "poll")
_done = False


def keep_collectives_eager() -> None:
    """Mark Comm's collectives and Handle's waits as never traced by torch.compile (idempotent)."""
    global _done
    if _done:
        return
    for name in COLLECTIVES:
        setattr(Comm, name, torch.compiler.disable(getattr(Comm, name), reason=f"Comm.{name}: counted and recorded"))
    for name in ("wait", "is_completed"):
        setattr(Handle, name, torch.compiler.disable(getattr(Handle, name), reason=f"Handle.{name}"))
    _done = True
