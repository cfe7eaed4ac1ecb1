"""The check of a `hf:DIR` start (checkpoint/logit_check.py `pretrained_check_line`): threefold's reader and
forward of the directory against transformers' forward, in fp32; a reader that maps two tensors to
each other's keys fails it naming the worst position; a model above the size rule is skipped with one
line. And the comparison itself: per position, NaN logits are the worst."""

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_tasks import save_tiny  # noqa: E402
from threefold.checkpoint import logit_check  # noqa: E402
from threefold.checkpoint.format import CheckpointError  # noqa: E402
from threefold.checkpoint.hf import pretrained  # noqa: E402
from threefold.models.registry import hf_spec  # noqa: E402


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    directory = save_tiny("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")
    return pretrained(hf_spec(directory, 0))


def test_a_hugging_face_start_matches_transformers(qwen2):
    line = logit_check.pretrained_check_line(qwen2, 250)
    assert line.startswith("init check: logits match transformers, max relative error "), line
    assert line.endswith(" over 4x16 tokens (bound 1e-05, float32)")


def test_a_reader_that_swaps_two_tensors_fails_the_check(qwen2):
    swapped = ((r"^blocks\.0\.layer\.mlp\.gate_proj\.", "model.layers.0.mlp.up_proj."),
               (r"^blocks\.0\.layer\.mlp\.up_proj\.", "model.layers.0.mlp.gate_proj."))
    fmt = replace(qwen2.hf, renames=swapped + qwen2.hf.renames)  # the bug: a wrong key map
    broken = pretrained(replace(qwen2, hf=fmt, weights=None))
    with pytest.raises(CheckpointError) as failed:
        logit_check.pretrained_check_line(broken, 250)
    message = str(failed.value)
    assert message.startswith("init check FAILED: logits differ from transformers at sequence "), message
    assert "nothing was trained" in message


def test_a_large_model_skips_the_check_with_one_line(qwen2, monkeypatch):
    monkeypatch.setattr(logit_check, "PRETRAINED_CHECK_MAX_PARAMS", 1000)
    line = logit_check.pretrained_check_line(qwen2, 250)
    assert line.startswith("init check skipped: ") and "parameters, above 1,000" in line, line


def test_the_worst_position_is_named_and_nan_is_worst():
    theirs = torch.randn(2, 3, 5)
    ours = theirs.clone()
    ours[1, 2, 0] += 1.0
    check = logit_check.compare(ours, theirs, "export", "float32")
    assert check.worst == (1, 2) and not check.ok and check.max_rel > 0.1
    ours = theirs.clone()
    ours[0, 1, 4] = float("nan")
    check = logit_check.compare(ours, theirs, "export", "float32")
    assert check.worst == (0, 1) and math.isinf(check.max_rel) and not check.ok
    assert logit_check.compare(theirs.clone(), theirs, "export", "float32").ok
