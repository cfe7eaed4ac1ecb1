"""The saved-tensor meter behind `mem.activations` (observe/memory.py): measured once per key."""

import torch
from torch import nn

from threefold.models.moe import MoE
from threefold.observe.memory import SavedTensorMeter
from threefold.pipeline.runtime import ModuleCompute
from threefold.pipeline.stage import Stage
from threefold.config import load_config


def _saves(n: int):
    x = torch.randn(n, requires_grad=True)
    return lambda: (x * x).sum()  # mul saves x twice: one storage, counted once


def test_a_key_is_measured_once_and_no_key_every_time():
    meter = SavedTensorMeter()
    assert meter.count("stage 0", _saves(10))[1] == 40
    assert meter.count("stage 0", _saves(20))[1] == 40  # the first measurement of the key
    assert meter.count("stage 1", _saves(20))[1] == 80
    assert meter.count(None, _saves(30))[1] == 120  # data-dependent: always measured
    assert meter.count(None, _saves(40))[1] == 160


class _Layers:
    def __init__(self, layers):
        self.layers = layers

    def layer(self, index: int) -> nn.Module:
        return self.layers[index]


def test_a_stage_with_routed_experts_is_measured_every_micro_batch():
    cfg = load_config(None, ["model.preset=tiny-moe"]).model
    module = _Layers([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), MoE(cfg))])
    compute = ModuleCompute(module, adapter=None)
    x = torch.zeros(2, 3, 4)
    assert compute._meter_key(Stage(0, range(0, 1), True, False), x) == (0, (2, 3, 4), torch.float32)
    assert compute._meter_key(Stage(1, range(1, 2), False, True), x) is None
