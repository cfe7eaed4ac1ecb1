"""Exact memory accounting: bytes of parameters, gradients, optimizer states, activations.

Bytes are counted per storage, once: a gradient that is a view into a bucket buffer counts the
buffer, tied weights count once. Activations are the tensors autograd saves for backward,
counted through saved-tensor hooks (parameters and buffers excluded, shared storages once).
"""

from __future__ import annotations

import contextlib

import torch


def allocation_peak(fn) -> int:
    """Peak of bytes allocated and not yet freed while `fn()` runs, from torch.profiler's CPU
    memory events (allocations minus frees, in order). For measurements, not for training loops:
    the profiler slows what it watches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward inside `measure()`.

    `current` is the bytes saved since the last `reset()` (one step's worth when reset per step);
    `peak` is the largest `current` seen. Tensors whose storage belongs to `exclude` (the
    parameters, also in their whole form under ZeRO-3) are not activations and are not counted.
    Storages are identified by their storage object, which survives re-allocation (resize).

    `count(key, run)` measures once per key: what autograd saves is fixed by the code run and the
    shapes and dtypes going in (`key`), so a pipeline stage is measured at its first micro-batch
    of each input shape and later ones reuse that figure without the per-tensor hook.
    """

    def __init__(self, exclude=()):
        self._excluded = {_storage_id(t) for t in exclude}
        self._seen: set[int] = set()
        self._known: dict = {}  # key -> bytes measured at its first `count`
        self.current = 0
        self.peak = 0

    def reset(self) -> None:
        self._seen.clear()
        self.current = 0

    def _pack(self, t: torch.Tensor):
        if t.device.type != "meta":
            key = _storage_id(t)
            if key not in self._excluded and key not in self._seen:
                self._seen.add(key)
                self.current += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.current)
        return t

    def count(self, key, run):
        """(`run()`, the bytes autograd saved during it). Measured at the first call with `key` (a
        hashable naming what fixes the saved bytes), reused afterwards; `key=None`: always measured
        (saved bytes that depend on the data, e.g. routed experts)."""
        known = self._known.get(key) if key is not None else None
        if known is not None:
            return run(), known
        self.reset()
        with self.measure():
            result = run()
        if key is not None:
            self._known[key] = self.current
        return result, self.current

    @contextlib.contextmanager
    def measure(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
