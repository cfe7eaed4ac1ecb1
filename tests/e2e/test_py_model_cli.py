"""`threefold train --model py:MODULE:FACTORY`: a user's own nn.Module (tests/engine_models.py's TinyLM)
trained by the command line under ZeRO-3 with activation checkpointing on 2 processes; `--tp 2` without a
plan is refused in one line (in process: it exits before any process starts)."""

import json

import pytest

from tests.e2e.cli import threefold
from threefold.cli import main

MODEL = "py:tests.engine_models:tiny_lm"


def test_py_model_trains_under_zero3_and_remat(tmp_path):
    run = threefold("train", "--model", MODEL, "--set", "model.vocab=64", "--nproc", "2", "--zero", "3",
                    "--activation-checkpointing", "full", "--steps", "4", "--seq-len", "16", "--global-batch", "4",
                    "--lr", "3e-3", "--out", str(tmp_path / "run"), "--no-progress", "--save-every", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert rows[-1]["comm"]["dp"]["all_gather"] > 0 and rows[-1]["comm"]["dp"]["reduce_scatter"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-00000004").is_dir()


def test_tp_without_a_plan_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", MODEL, "--set", "model.vocab=64", "--tp", "2", "--nproc", "2",
              "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tp" in err[0] and "plan" in err[0], err
