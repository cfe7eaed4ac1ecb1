"""`--resume auto` continues the run with its own options: DIR/config.toml is the default, the options
given again override it."""

import tomllib

from tests.e2e.cli import threefold


def test_resume_takes_the_runs_own_options(tmp_path):
    out = str(tmp_path / "run")
    first = threefold("train", "--model", "tiny", "--steps", "4", "--save-every", "2", "--seq-len", "16",
                      "--out", out, "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    # neither the model nor --save-every given again: both come from the run's config.toml
    again = threefold("train", "--out", out, "--resume", "auto", "--steps", "6", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and (tmp_path / "run" / "checkpoints" / "step-00000006").is_dir()
    cfg = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert cfg["model"]["preset"] == "tiny" and cfg["checkpoint"]["save_every"] == 2 and cfg["train"]["seq_len"] == 16
    # an option given on the command line overrides the run's own
    third = threefold("train", "--out", out, "--resume", "auto", "--steps", "9", "--save-every", "3", "--no-progress")
    assert third.returncode == 0, third.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000009").is_dir()
    assert tomllib.loads((tmp_path / "run" / "config.toml").read_text())["checkpoint"]["save_every"] == 3
