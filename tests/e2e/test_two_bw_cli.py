"""`--schedule pipedream-2bw` from the command line: a short run, a resume, and the refusals."""

import json

from tests.e2e.cli import threefold

TWO_BW = ["--nproc", "2", "--pp", "2", "--microbatches", "2", "--schedule", "pipedream-2bw", "--model", "tiny",
          "--global-batch", "4", "--seq-len", "16", "--no-progress", "--set", "train.grad_clip=0",
          "--set", "model.tie_embeddings=false", "--set", "run.plot=false", "--set", "checkpoint.save_every=2",
          "--set", "train.min_lr_ratio=1.0"]  # a constant rate: a 2-step run and a 4-step run share it


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_bw_trains_and_a_resume_continues_the_run_exactly(tmp_path):
    whole = tmp_path / "whole"
    run = threefold("train", *TWO_BW, "--steps", "4", "--out", str(whole))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the first step after a flush (the start; the save at step 2 drains) applies no update - the
    # drain applied the previous batch's -; the others apply the previous batch's
    assert [r["grad_norm"] == 0.0 and r["lr"] == 0.0 for r in rows] == [True, False, True, False]
    assert all(r["grad_norm"] > 0 and r["lr"] > 0 for r in (rows[1], rows[3]))
    # a checkpoint is written drained (every update applied); resuming from it is the run that continued
    part = tmp_path / "part"
    assert threefold("train", *TWO_BW, "--steps", "2", "--out", str(part)).returncode == 0
    resumed = threefold("train", *TWO_BW, "--steps", "4", "--resume", "auto", "--out", str(part))
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(part) == _losses(whole)


def test_two_bw_refusals_exit_2_with_one_line(tmp_path):
    tied = TWO_BW.index("model.tie_embeddings=false")
    args = TWO_BW[:tied - 1] + TWO_BW[tied + 1:]
    run = threefold("train", *args, "--steps", "2", "--out", str(tmp_path))  # tied embeddings, the default
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.tie_embeddings: " in lines[0], run.stderr
