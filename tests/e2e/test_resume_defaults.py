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


def test_a_layout_the_resumed_run_kept_names_where_it_came_from(tmp_path, monkeypatch, capsys):
    """The run's config.toml asks for cp=2 and tp=2; resumed on one process, the world-size error says
    that those values came from that file and which options override them."""
    from threefold.cli import main
    from threefold.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.toml").write_text(
        load_config(None, ["model.preset=tiny", "parallel.cp=2", "parallel.tp=2", "run.out=x"]).to_toml())
    assert main(["train", "--out", "x", "--resume", "auto"]) == 2
    assert capsys.readouterr().err.strip() == (
        "threefold: error: parallel: layout dp=auto x cp=2 x tp=2 x pp=1 does not match the world size 1; choose "
        "dp, cp, tp and pp whose product is 1 (parallel.tp=2 and parallel.cp=2 came from x/config.toml of the "
        "resumed run; pass --tp 1 --cp 1 / --set parallel.tp=1 --set parallel.cp=1 to override)")
    # a value given again is not the file's: only cp is named
    assert main(["train", "--out", "x", "--resume", "auto", "--set", "parallel.tp=1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "(parallel.cp=2 came from x/config.toml of the resumed run; pass --cp 1 / --set parallel.cp=1 to override)")
    # without --resume the file is not read, and the same layout given on the command line names no file
    assert main(["train", "--out", "x", "--cp", "2"]) == 2
    assert "came from" not in capsys.readouterr().err
