"""Would activation offload (`remat.offload=cpu`) make a layout fit, and what its copies cost.

For the closest layouts that do not fit, the planner re-prices them with every block's saved
activations in host memory (memory.py: the offloaded bytes leave the device's `activations` and
become `activations_host`; the backward holds two offloaded blocks on the device again, a
transient). The copies cross the host link twice per step (out in the forward, back ahead of the
backward): `copy_s` = 2 x host bytes per micro-batch x micro-batches / HOST_LINK_BYTES_PER_S. They
run on a side stream, so they are hidden when the compute of the step is longer; what exceeds it
is added to the step (`exposed_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import GiB
from .memory import rank_memory
from .search import PlanResult
from .step_time import step_time

HOST_LINK_BYTES_PER_S = 25e9  # PCIe Gen4 x16, one direction, effective (Gen5: about twice)
CLOSEST = 5  # layouts that do not fit, tried with offload


@dataclass(frozen=True)
class OffloadOption:
    label: str
    device_bytes: float
    host_bytes: float  # per GPU
    copy_s: float
    step_s: float
    fits: bool

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.copy_s - self.step_s)

    def describe(self) -> str:
        verdict = "fits" if self.fits else "still does not fit"
        hidden = "hidden behind the step" if not self.exposed_s else f"{self.exposed_s:.3g} s of it exposed"
        return (f"with remat.offload=cpu, {self.label} {verdict}: {self.device_bytes / GiB:.1f} GiB on the GPU, "
                f"{self.host_bytes / GiB:.1f} GiB of activations in host memory; copies {self.copy_s:.3g} s per "
                f"step against {self.step_s:.3g} s of step ({hidden})")

    def as_dict(self) -> dict:
        return {"layout": self.label, "device_bytes": int(self.device_bytes), "host_bytes": int(self.host_bytes),
                "copy_s": self.copy_s, "step_s": self.step_s, "exposed_s": self.exposed_s, "fits": self.fits}


def offload_options(result: PlanResult, host_bytes_per_s: float = HOST_LINK_BYTES_PER_S) -> list[OffloadOption]:
    """The closest layouts that do not fit, re-priced with every block's activations offloaded."""
    w, gpu = result.workload, result.gpu
    out = []
    for c in [c for c in result.candidates if not c.fits][:CLOSEST]:
        st = replace(c.strategy, act_offload=tuple(range(w.model.layers)))
        mem = rank_memory(w, st, gpu)
        copy_s = 2 * mem.activations_host * st.microbatches / host_bytes_per_s
        out.append(OffloadOption(st.label(), mem.total, mem.activations_host, copy_s,
                                 step_time(w, st, gpu).total_s, mem.total <= gpu.memory_bytes))
    return out


def offload_advice(result: PlanResult) -> OffloadOption | None:
    """The fastest closest layout that fits only with activation offload (None: none does, or a layout
    fits without it)."""
    if result.feasible:
        return None
    fitting = [o for o in offload_options(result) if o.fits]
    return min(fitting, key=lambda o: o.step_s + o.exposed_s) if fitting else None
