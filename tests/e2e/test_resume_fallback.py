"""Under `--max-restarts`, `--resume auto` falls back past a newest checkpoint that would not load
(its manifest names a tensor its file lacks; sizes and sha256 match) in the first attempt, with
one line, instead of failing with exit 2 in every attempt."""

import json

from tests.e2e.test_recovery import COMMON, finish, losses, start
from threefold.checkpoint.format import MANIFEST, step_dir_name


def test_resume_auto_under_max_restarts_falls_back_past_an_unloadable_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--model", "tiny", "--nproc", "2", *COMMON, "--out", str(run)]
    rc, log = finish(start([*args, "--steps", "4"]))
    assert rc == 0, log[-3000:]
    newest = run / "checkpoints" / step_dir_name(4)
    raw = json.loads((newest / MANIFEST).read_text())
    tensor = next(n for n in sorted(raw["tensors"]) if n.startswith("model/"))
    raw["tensors"][tensor]["slices"][0]["key"] += "-elsewhere"
    (newest / MANIFEST).write_text(json.dumps(raw))
    rc, log = finish(start([*args, "--max-restarts", "1", "--resume", "auto"]))
    assert rc == 0, log[-3000:]
    failed = [line for line in log.splitlines() if "failed verification" in line]
    assert len(failed) == 1 and "has no tensor" in failed[0] and "skipping it" in failed[0], log[-3000:]
    assert f"resumed from {run / 'checkpoints' / step_dir_name(2)}" in log and "restarting" not in log, log[-3000:]
    assert [s for s, _ in losses(run)] == [1, 2, 3, 4, 5, 6]
