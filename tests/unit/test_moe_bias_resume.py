"""The expert bias of `model.router_balance=bias` is training state: a checkpoint holds it (in fp32, as the
run keeps it under bf16) and a resumed run continues with it, equal to the run that never stopped."""

import contextlib
import io

import torch

from tests.helpers import make_config

BIAS = ["model.preset=tiny-moe", "model.router_balance=bias", "model.router_bias_rate=0.01", "train.seq_len=16",
        "train.global_batch=4", "train.warmup_steps=0", "train.min_lr_ratio=1", "precision.compute=bf16",
        "checkpoint.save_every=2"]


def _run(out, steps: int, *extra: str):
    from threefold.train.trainer import Trainer

    with contextlib.redirect_stderr(io.StringIO()):
        trainer = Trainer(make_config([*BIAS, f"train.steps={steps}", *extra], str(out)))
        records = trainer.run()
    biases = {n: b.clone() for n, b in trainer.parallel.module.named_buffers() if n.endswith("expert_bias")}
    return [r["loss"] for r in records], biases


def test_a_resumed_bias_run_continues_with_the_saved_bias(tmp_path):
    losses, biases = _run(tmp_path / "whole", 4)
    assert all(b.dtype == torch.float32 for b in biases.values()) and any(b.abs().sum() > 0 for b in biases.values())
    _run(tmp_path / "split", 2)
    resumed, resumed_biases = _run(tmp_path / "split", 4, "checkpoint.resume=auto")
    assert resumed == losses[2:]
    for name, bias in biases.items():
        assert torch.equal(resumed_biases[name], bias), name
