"""Compute slowed by the collectives that overlap it (planner/step_time.py `overlap_interference`): a data-parallel
or ZeRO collective hidden behind compute still holds multiprocessors and HBM bandwidth, so the compute beside it
runs `Gpu.overlap_slowdown` slower (0.189: Lee et al. 2025, arXiv:2507.03114, the average slowdown measured on
A100 and H100; planner/hardware.py). The step is charged hidden x d / (1 + d) for it."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.errors import UserError
from threefold.planner.hardware import PRESETS, gpu_toml, load_gpu
from threefold.planner.search import components, evaluate
from threefold.planner.workload import Strategy, Workload

H100 = PRESETS["h100-80gb"]


def _plan(gpu=H100, grad_overlap=True, zero=3):
    m = load_config(None, ["model.preset=llama-7b"]).model
    w = Workload(m, 64, 4096, grad_overlap=grad_overlap)
    return evaluate(w, Strategy(dp=64, zero=zero, microbatches=1, remat="selective"), gpu).time


def test_the_published_slowdown_is_every_presets():
    assert all(g.overlap_slowdown == pytest.approx(0.189) for g in PRESETS.values())


def test_hidden_collectives_slow_the_compute_beside_them():
    """ZeRO-3 over 8 H100 nodes: its gathers and reduce-scatters hide behind compute, and the step pays
    0.189 / 1.189 of the hidden seconds; the breakdown's terms still add up to the step."""
    t = _plan()
    hidden = t.dp_comm_s - t.dp_exposed_s
    assert hidden > 0.1 * t.total_s
    assert t.overlap_slowdown_s == pytest.approx(hidden * 0.189 / 1.189)
    assert t.total_s == pytest.approx(t.pipeline_s + t.dp_exposed_s + t.overlap_slowdown_s + t.optimizer_s)
    assert sum(components(t).values()) == pytest.approx(t.total_s)
    assert components(t)["compute slowed by overlapped collectives"] == t.overlap_slowdown_s
    assert "overlap_slowdown_s" in t.as_dict()


def test_without_overlap_or_without_the_slowdown_nothing_is_charged():
    after_flush = _plan(grad_overlap=False, zero=0)  # 2021-22 software: gradients reduced after the backward
    assert after_flush.dp_exposed_s == pytest.approx(after_flush.dp_comm_s) and after_flush.overlap_slowdown_s == 0
    free = _plan(replace(H100, overlap_slowdown=0.0))
    t = _plan()
    assert free.overlap_slowdown_s == 0 and t.total_s - free.total_s == pytest.approx(t.overlap_slowdown_s)


def test_a_gpu_file_carries_the_slowdown(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text(gpu_toml(replace(H100, name="h100 no interference", overlap_slowdown=0.0)))
    assert load_gpu(str(path)).overlap_slowdown == 0.0
    path.write_text(gpu_toml(H100))
    assert load_gpu(str(path)).overlap_slowdown == H100.overlap_slowdown
    path.write_text(gpu_toml(H100).replace("overlap_slowdown = 0.189", "overlap_slowdown = -0.1"))
    with pytest.raises(UserError, match="overlap_slowdown"):
        load_gpu(str(path))
