"""Bytes per parameter that model and optimizer hold, per precision mode (docs/zero.md, "Bytes per
parameter"): every floating-point tensor storage alive after one training step that was not alive
before the trainer was built (found by the garbage collector, so a copy kept anywhere counts, not
only what the optimizer lists), and the same while the optimizer's update runs. Scalars (step
counts, the loss scale) are left out; a GPT-2-shaped model of 2 blocks, one process."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers import make_config

# (held after a step, held during the update) in bytes per trainable parameter
EXPECTED = {
    "fp32": (16, 16),  # param 4 (its own master), grad 4, exp_avg 4, exp_avg_sq 4
    "bf16": (16, 20),  # param 2, grad 2, fp32 master 4, exp_avg 4, exp_avg_sq 4; + fp32 grad 4 in the update
    "fp16": (16, 20),  # as bf16; the loss scale is a scalar
    "fp8": (16, 20),   # as bf16: torchao keeps the weights bf16, their float8 casts live inside a forward
}


def _storages() -> dict[int, int]:
    """{storage address: bytes} of every floating-point tensor of more than one element alive now."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
                address = storage.data_ptr()
            except RuntimeError:  # a fake tensor an earlier compile in this process keeps (no data): not ours
                continue
            if storage.nbytes() > obj.element_size():
                out[address] = storage.nbytes()
    return out


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_bytes_per_parameter_after_a_step_and_during_the_update(mode, alone, tmp_path):
    from threefold.train.trainer import Trainer

    before = _storages()
    overrides = ["model.preset=tiny", "model.layers=2", "model.hidden=64", "train.global_batch=4",
                 "train.seq_len=16", "train.steps=2", "data.prefetch=0", f"precision.compute={mode}"]
    if mode == "fp8":
        overrides.append("precision.fp8_linears=all")
    trainer = Trainer(make_config(overrides, str(tmp_path / "run")))
    inner, during = trainer.optimizer.inner, {}
    step = inner.step

    def counted_step(*args, **kwargs):
        during.update(_storages())
        return step(*args, **kwargs)

    inner.step = counted_step
    trainer.train_one_step()
    after = _storages()
    trainer.loader.close()
    n = sum(p.numel() for p in trainer.parallel.module.parameters() if p.requires_grad)
    held = sum(b for ptr, b in after.items() if ptr not in before) / n
    updating = sum(b for ptr, b in during.items() if ptr not in before) / n
    assert (round(held, 1), round(updating, 1)) == EXPECTED[mode], (held, updating)
