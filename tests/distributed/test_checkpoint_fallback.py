"""`--resume auto` falls back past a checkpoint that would not load, with one line: a manifest
naming a tensor its file does not hold passes sizes and sha256, and used to be picked and fail."""

import json

import torch

from tests.distributed.test_checkpoint import BASE, train_task
from threefold.checkpoint import verify
from threefold.checkpoint.format import MANIFEST, step_dir_name


def test_resume_auto_falls_back_past_a_checkpoint_that_does_not_load(worlds, tmp_path):
    overrides = BASE + ["train.steps=6", "checkpoint.save_every=3", "checkpoint.keep=2"]
    first = worlds(2).run(train_task, overrides, str(tmp_path))
    newest = tmp_path / "checkpoints" / step_dir_name(6)
    raw = json.loads((newest / MANIFEST).read_text())
    name = "model/blocks.0.mlp.up.weight"
    raw["tensors"][name]["slices"][0]["key"] += "-elsewhere"  # the data files are untouched: checksums match
    (newest / MANIFEST).write_text(json.dumps(raw))
    problems = verify(newest)[1]
    assert len(problems) == 1 and "has no tensor" in problems[0], problems
    second = worlds(2).run(train_task, overrides + ["checkpoint.resume=auto"], str(tmp_path))
    lines = [line for r in second for line in r["stderr"].splitlines() if "failed verification" in line]
    assert len(lines) == 1 and "skipping it for an earlier checkpoint" in lines[0] and "has no tensor" in lines[0], \
        lines
    for r, f in zip(second, first):
        assert r["resumed_from"] == step_dir_name(3)
        assert r["losses"] == f["losses"][3:]
        assert all(torch.equal(r["params"][k], f["params"][k]) for k in f["params"])
    assert verify(newest)[1] == []  # saved again, replacing the one that did not load
