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
