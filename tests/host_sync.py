"""Count host synchronisations: every read of a tensor's value back to the host.

`.item()`, `float(t)`, `int(t)`, `bool(t)` (and `if t:`) all go through the operator
`aten._local_scalar_dense`; `torch.equal`, `nonzero` and `is_nonzero` read values too; a copy
from an accelerator to the CPU (`.cpu()`, `.tolist()` of a CUDA tensor) is a `_to_copy` or
`copy_` whose source is not on the CPU. A dispatch mode sees each of them where it happens,
including inside torch's own Python and C++ code, on the thread that runs the step (autograd
carries the mode into backward).
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.nonzero.default}


def _device_to_host(func, args, kwargs) -> bool:
    if func not in (aten._to_copy.default, aten.copy_.default):
        return False
    src = args[1] if func is aten.copy_.default else args[0]
    dst_cpu = (args[0].device.type == "cpu") if func is aten.copy_.default else \
        (kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu")
    return isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst_cpu


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as c: ...`; then `c.count` and `c.sites` (the Python line of each read)."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    @property
    def count(self) -> int:
        return len(self.sites)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or _device_to_host(func, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if "host_sync.py" not in f.filename]
            where = next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
            self.sites.append(f"{func} at {where.filename}:{where.lineno}")
        return func(*args, **kwargs)
