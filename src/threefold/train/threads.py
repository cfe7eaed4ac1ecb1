"""torch's CPU threads per training process (run.threads): one line says how many and why.

torch starts one intra-op thread per core in every process, so N local processes on C cores
would run N x C threads. The fair share C / N is the default; on a machine that other jobs share
even that can be too many (one process on 2 busy cores took 1.8-6.3 s a step with 2 threads and
0.14-0.28 s with 1, same losses), so OMP_NUM_THREADS and run.threads choose the count instead.
"""

from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..mesh import local_world_size


def choose_cpu_threads(setting: int, omp_num_threads: str | None, cores: int, local: int) -> tuple[int, str]:
    """torch's intra-op threads for one process and where the count came from: run.threads when
    set (> 0; its domain, config/domains.py, refuses a negative one), else OMP_NUM_THREADS when set
    (its first level, as OpenMP reads "4,2"), else the fair share of the cores among the local
    processes (torch would start one thread per core in each)."""
    if setting > 0:
        return setting, "run.threads"
    if omp_num_threads is not None and omp_num_threads.strip():
        first = omp_num_threads.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise UserError(f"OMP_NUM_THREADS={omp_num_threads!r} is not a positive whole number; set one, "
                            "unset it, or set run.threads")
        return int(first), "OMP_NUM_THREADS"
    return max(1, cores // max(1, local)), "cores/local"


def share_cpu_threads(setting: int) -> tuple[int, str]:
    """Set this process's torch threads (`choose_cpu_threads`); returns the count and its source."""
    threads, source = choose_cpu_threads(setting, os.environ.get("OMP_NUM_THREADS"), len(os.sched_getaffinity(0)),
                                         local_world_size())
    torch.set_num_threads(threads)
    return threads, source
