"""The gradient bucket size that exposes the least data-parallel communication, by the plan's own model.

A bucket pays one collective's latency (planner/comm.py: NCCL's ring and tree over the dp group's nodes), and
the last bucket of the backward is always exposed (planner/dp_comm.py `bucket_tail`): small buckets pay many
latencies, large ones leave a large last bucket. `exposed_by_bucket` prices a layout at each size; the runtime's
default (`parallel.bucket_mb`, 25 MiB, as torch DDP's `bucket_cap_mb`) is checked against it in
tests/unit/test_planner_dp_sync.py, and docs/planner.md prints the figures.
"""

from __future__ import annotations

from dataclasses import replace

from .hardware import Gpu
from .step_time import step_time
from .workload import Strategy, Workload

SIZES_MB = (1.0, 4.0, 10.0, 25.0, 50.0, 100.0, 400.0, 1000.0)


def exposed_by_bucket(w: Workload, st: Strategy, gpu: Gpu, sizes=SIZES_MB) -> dict[float, float]:
    """Exposed data-parallel seconds of one step of `st` at each bucket size (MiB)."""
    return {mb: step_time(w, replace(st, bucket_mb=mb), gpu).dp_exposed_s for mb in sizes}


def best_bucket_mb(w: Workload, st: Strategy, gpu: Gpu, sizes=SIZES_MB) -> float:
    """The size among `sizes` that exposes the least (the smallest of equals)."""
    exposed = exposed_by_bucket(w, st, gpu, sizes)
    return min(sizes, key=lambda mb: (exposed[mb], mb))
