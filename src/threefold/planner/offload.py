"""Offloaded optimizer states in the plan: `parallel.offload=optimizer` (host memory) and `=nvme`.

Either offload moves a rank's fp32 masters and optimizer moments (the `optimizer` term of
planner/memory.py, already sharded by ZeRO >= 1) off the device: the device's bytes drop by
that term, and the bytes go to host memory or to the node's NVMe. The step pays for it:

    host   the update runs on the host over the states: read and write them once in host
           memory (HOST_BYTES_PER_S), plus the gradients down and the parameters up over PCIe
    nvme   the same, plus reading and writing the states from the scratch files at the
           node's NVMe bandwidth shared by its GPUs (`--nvme-gbps`, GB/s per node); the reads
           of the next unit overlap the update of this one (parallel/nvme.py), so the step
           waits for the larger of the two, counted here as the NVMe time alone

Host memory per GPU is `--host-gib` per node over its GPUs; a layout whose offloaded states do
not fit there cannot use host offload (nvme then still can). The plan lists, for the layouts
the search kept, the best one that fits only with offload, and says so when nothing fits
without it (`advise`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import GiB, Gpu
from .memory import ALLOCATOR_MARGIN
from .search import Candidate, PlanResult

HOST_GIB_PER_NODE = 2048.0  # a DGX-class node's host memory (8 x H100 nodes ship with 2 TiB)
NVME_GBPS_PER_NODE = 25.0  # GB/s: eight datacenter NVMe drives striped (about 3 GB/s each)
HOST_BYTES_PER_S = 50e9  # host memory bandwidth one GPU's share of the update sees
PCIE_BYTES_PER_S = 25e9  # host <-> device, one direction, per GPU (PCIe 5 x16, effective)


@dataclass(frozen=True)
class OffloadOption:
    candidate: Candidate
    mode: str  # "optimizer" (host memory) or "nvme"
    device_bytes: float  # the device's total without the optimizer states
    offloaded_bytes: float  # per GPU, on the host or on NVMe
    extra_s: float  # added to the step
    tokens_per_s: float

    def as_dict(self) -> dict:
        return {"layout": self.candidate.strategy.label(), "offload": self.mode, "device_bytes": int(self.device_bytes),
                "offloaded_bytes": int(self.offloaded_bytes), "extra_step_s": self.extra_s,
                "tokens_per_s": self.tokens_per_s}


def offload_options(c: Candidate, gpu: Gpu, tokens: int, host_gib: float, nvme_gbps: float) -> list[OffloadOption]:
    """Host and NVMe offload of candidate `c` that fit (ZeRO >= 1, as threefold requires)."""
    if c.strategy.zero < 1 or c.time is None:
        return []
    mem = c.memory
    states = mem.optimizer
    device = mem.total - states * (1 + (ALLOCATOR_MARGIN if mem.margin else 0.0))  # its allocator margin too
    if device > gpu.memory_bytes:
        return []
    # the gradients (fp32) down and the updated parameters up, over each GPU's own link
    pcie = (mem.grads * 2 + mem.params) / PCIE_BYTES_PER_S
    host_s = 2 * states / HOST_BYTES_PER_S + pcie
    out = []
    if states <= host_gib * GiB / gpu.gpus_per_node:
        out.append(OffloadOption(c, "optimizer", device, states, host_s, tokens / (c.time.total_s + host_s)))
    nvme_s = max(2 * states / (nvme_gbps * 1e9 / gpu.gpus_per_node), host_s)
    out.append(OffloadOption(c, "nvme", device, states, nvme_s, tokens / (c.time.total_s + nvme_s)))
    return out


def advise(result: PlanResult, host_gib: float = HOST_GIB_PER_NODE,
           nvme_gbps: float = NVME_GBPS_PER_NODE) -> tuple[OffloadOption | None, list[str]]:
    """The fastest offloaded layout (over the candidates that do not fit without offload, or all
    of them when none fits) and the lines the plan prints."""
    pool = result.candidates if not result.feasible else [c for c in result.candidates if not c.fits]
    options = [o for c in pool for o in offload_options(c, result.gpu, result.workload.tokens, host_gib, nvme_gbps)]
    if not options:
        if result.feasible:
            return None, []
        return None, [f"offload: no layout fits even with its optimizer states off the device "
                      f"(--host-gib {host_gib:g}, --nvme-gbps {nvme_gbps:g})"]
    best = max(options, key=lambda o: o.tokens_per_s)
    where = "host memory" if best.mode == "optimizer" else "NVMe"
    line = (f"{best.candidate.strategy.label()} with parallel.offload={best.mode}: {best.device_bytes / GiB:.1f} GiB/GPU "
            f"on the device, {best.offloaded_bytes / GiB:.1f} GiB/GPU in {where}, +{best.extra_s:.3g} s per step, "
            f"{best.tokens_per_s:,.0f} tokens/s")
    if result.feasible:
        return best, [f"offload: {line} (slower than the best layout, which needs none)"
                      if best.tokens_per_s < result.best.tokens_per_s else f"offload: {line} (faster)"]
    return best, [f"offload is the only way to fit: {line}"]
