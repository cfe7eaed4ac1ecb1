"""The CUDA / NCCL path; skipped on machines without a GPU (CI has none: run `bash bench/gpu.sh`)."""

import json

import pytest
import torch

from tests.e2e.cli import threefold

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_on_one_gpu_over_nccl(tmp_path, precision):
    run = threefold("train", "--nproc", "1", "--model", "tiny", "--steps", "5", "--global-batch", "8",
                    "--seq-len", "32", "--precision", precision, "--set", "run.device=cuda", "--no-progress",
                    "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["mem"]["peak"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_cuda_step_never_synchronises_with_the_host(tmp_path, precision):
    """torch's sync debug mode raises at any blocking device-to-host wait inside the step (the CPU
    test counts reads in tests/distributed/test_host_sync.py; this is the same claim on the device)."""
    from tests.helpers import make_config
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "train.steps=3",
                                   "run.device=cuda", f"precision.compute={precision}", "data.prefetch=0"],
                                  str(tmp_path)))
    trainer.train_one_step()
    step = trainer.step + 1
    micro_batches, _ = trainer.loader.get(step - 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = trainer.step_fn(step, micro_batches, trainer.global_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    trainer.loader.close()
    assert result.read()[1] == 0.0  # not skipped


def test_the_figures_copy_is_pinned_non_blocking_and_the_peak_is_the_steps(tmp_path):
    """Issuing a step and its figures' copy never blocks the host (sync debug mode raises at a
    blocking wait); the copy lands in pinned memory; each step's peak is reset as it begins."""
    from tests.helpers import make_config
    from threefold.train.step import start_read
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "train.steps=3",
                                   "run.device=cuda", "precision.compute=bf16", "data.prefetch=0"], str(tmp_path)))
    first = trainer.train_one_step()
    step = trainer.step + 1
    micro_batches, _ = trainer.loader.get(step - 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = trainer.step_fn(step, micro_batches, trainer.global_tokens)
        pending = start_read(trainer.figures(result, result.loss_sum), trainer.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.device.host_buffer(1).is_pinned()
    values = pending.values()
    assert values["skipped"] == 0.0 and values["loss_scale"] == 1.0 and values["loss_total"] > 0
    trainer.device.reset_memory_peak()
    assert trainer.device.memory_peak() <= first["mem"]["peak"]
    trainer.loader.close()


def test_the_device_index_names_a_visible_gpu():
    from threefold.mesh import cuda_index

    assert 0 <= cuda_index({"LOCAL_RANK": "7"}) < torch.cuda.device_count()
