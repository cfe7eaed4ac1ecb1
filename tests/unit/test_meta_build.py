"""Building on the meta device skips the random fills of meta tensors (models/meta.py `on_meta`): a meta
`normal_` runs torch's Python reference, whose first call imports torch._dynamo and inductor's
modules, and each one costs a model build ~0.1 s more (a 4-rank tiny run's Trainer build 0.87 -> 0.64 CPU-s)."""

import subprocess
import sys

import torch
from torch import nn

from threefold.models.meta import on_meta

BUILD = """
import sys
from threefold.config import load_config
from threefold.models.decoder import build_model, count_parameters
cfg = load_config(None, ["model.preset=tiny-llama"]).model
count_parameters(cfg)
model = build_model(cfg, seed=0)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_building_the_reference_decoder_imports_no_compiler():
    run = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", run.stdout


def test_only_meta_tensors_skip_their_fills():
    with on_meta():
        layer = nn.Embedding(8, 4)
        real = torch.zeros(16, device="cpu")
        real.normal_()
        torch.nn.init.uniform_(real, 2.0, 3.0)
    assert layer.weight.is_meta
    assert bool(((real >= 2.0) & (real <= 3.0)).all())  # the host tensor was filled, both times
    assert torch.empty(2).device.type == "cpu"  # the device context ends with the block
