"""The planner's offload terms (planner/offload.py): device bytes without the optimizer states,
host or NVMe bytes and time, and the plan saying when offload is the only way to fit."""

import pytest

from tests.unit.test_planner_search import H100, workload
from threefold.planner.hardware import GiB
from threefold.planner.offload import advise, offload_options
from threefold.planner.search import search


@pytest.fixture(scope="module")
def llama70b_on_8():
    return search(workload("llama-70b", 64), 8, H100)


def test_offload_is_the_only_way_to_fit(llama70b_on_8):
    r = llama70b_on_8
    assert not r.feasible  # 16 bytes per parameter of 69B over 8 GPUs is 138 GiB each
    best, lines = advise(r, host_gib=2048, nvme_gbps=25)
    assert best is not None and best.mode == "optimizer" and best.candidate.strategy.zero >= 1
    assert lines[0].startswith("offload is the only way to fit: ") and "parallel.offload=optimizer" in lines[0]
    mem = best.candidate.memory
    assert best.device_bytes <= H100.memory_bytes < mem.total
    assert best.device_bytes == pytest.approx(mem.total - 1.1 * mem.optimizer)
    assert best.offloaded_bytes == mem.optimizer > 0
    # too little host memory per GPU for the states: NVMe, paying 2 x states at an eighth of the node's bandwidth
    small, lines = advise(r, host_gib=8 * best.offloaded_bytes / GiB * 0.9, nvme_gbps=25)
    assert small.mode == "nvme" and "parallel.offload=nvme" in lines[0]
    assert small.extra_s >= 2 * small.offloaded_bytes / (25e9 / 8) * 0.999
    opts = offload_options(small.candidate, H100, r.workload.tokens, 2048, 50)
    assert {o.mode for o in opts} == {"optimizer", "nvme"}
    assert next(o for o in opts if o.mode == "nvme").extra_s < small.extra_s  # twice the bandwidth


def test_a_feasible_plan_mentions_offload_only_where_it_helps():
    r = search(workload("tiny", 8, 64), 1, H100)
    assert r.feasible
    assert advise(r)[1] == []
