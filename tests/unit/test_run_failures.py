"""The failures that are left end in one line and exit 2: a read-only run directory, a config that
is not UTF-8, a float option that is not finite, a checkpoint directory removed during the run, a
disk too full for the next save (a save prunes first where checkpoint.keep lets it), and a
`runs/latest` that is not a link."""

import errno
import os
import shutil

import pytest

from tests.helpers import make_config
from threefold.checkpoint import checkpointer, writer
from threefold.errors import UserError

BASE = ["model.preset=tiny", "model.layers=1", "train.global_batch=2", "train.seq_len=16"]


def _train(out, *overrides):
    from threefold.train.trainer import Trainer

    return Trainer(make_config(BASE + list(overrides), str(out))).run()


def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def _du(root) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


class ShortDisk:
    """A disk of `capacity` bytes holding only the checkpoints: `free_bytes` says what is left and a
    file written past it fails as a full disk does (ENOSPC)."""

    def __init__(self, monkeypatch, root, capacity: int):
        self.root, self.capacity = root, capacity
        monkeypatch.setattr(checkpointer, "free_bytes", lambda path: self.capacity - _du(self.root))
        write = writer.write_rank

        def write_rank(partial, rank, pieces, *args):
            if _du(self.root) + sum(p.data.numel() * p.data.element_size() for p in pieces) > self.capacity:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "rank-00000.safetensors"))
            return write(partial, rank, pieces, *args)

        monkeypatch.setattr(checkpointer, "write_rank", write_rank)


def test_a_short_disk_prunes_before_the_save_what_keep_would_prune_after(tmp_path, monkeypatch, capsys, alone):
    _train(tmp_path / "one", "train.steps=1", "checkpoint.save_every=1")
    size = _du(tmp_path / "one" / "checkpoints")
    root = tmp_path / "run" / "checkpoints"
    ShortDisk(monkeypatch, root, int(2.5 * size))  # room for two checkpoints, not three
    _train(tmp_path / "run", "train.steps=4", "checkpoint.save_every=1", "checkpoint.keep=2")
    assert _steps(root) == ["step-00000003", "step-00000004"]
    err = capsys.readouterr().err
    assert "removed step-00000001 first, which checkpoint.keep=2 would remove after the save" in err, err


@pytest.mark.parametrize("keep, words", [(0, "set checkpoint.keep (now 0"), (1, "checkpoint.keep=1 lets go")])
def test_a_disk_too_short_even_after_pruning_is_one_line(keep, words, tmp_path, monkeypatch, alone):
    _train(tmp_path / "one", "train.steps=1", "checkpoint.save_every=1")
    size = _du(tmp_path / "one" / "checkpoints")
    root = tmp_path / "run" / "checkpoints"
    ShortDisk(monkeypatch, root, int(1.5 * size))
    with pytest.raises(UserError) as err:
        _train(tmp_path / "run", "train.steps=3", "checkpoint.save_every=1", f"checkpoint.keep={keep}")
    text = str(err.value)
    assert text.startswith("checkpoint: saving step 2 needs about") and words in text and "\n" not in text, text
    assert _steps(root) == ["step-00000001"]  # the last good checkpoint stays


def test_a_full_disk_during_the_write_is_one_line(tmp_path, monkeypatch, alone):
    root = tmp_path / "run" / "checkpoints"
    disk = ShortDisk(monkeypatch, root, 1 << 40)
    monkeypatch.setattr(checkpointer, "free_bytes", lambda path: 1 << 40)  # the estimate says it fits
    disk.capacity = 1000
    with pytest.raises(UserError) as err:
        _train(tmp_path / "run", "train.steps=1", "checkpoint.save_every=1")
    text = str(err.value)
    assert text.startswith("checkpoint: no space left to save step 1 under") and "checkpoint.keep" in text, text


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_directory_removed_during_the_save_is_one_line(async_save, tmp_path, monkeypatch, alone):
    write = writer.write_rank

    def removed(partial, *args):
        shutil.rmtree(partial.parent)  # e.g. `rm -r run/checkpoints` while a save is being written
        return write(partial, *args)

    monkeypatch.setattr(checkpointer, "write_rank", removed)
    with pytest.raises(UserError) as err:
        _train(tmp_path / "run", "train.steps=2", "checkpoint.save_every=1", f"checkpoint.async_save={async_save}")
    text = str(err.value)
    assert text.startswith(f"checkpoint: {tmp_path / 'run' / 'checkpoints'} was removed while step 1 was saved")
    assert "--resume auto" in text and "\n" not in text, text


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threefold: error: "), err
    return err[0]


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    from threefold.cli import main

    config = tmp_path / "run.toml"
    config.write_bytes("[train]\nsteps = 2 # caf\u00e9\n".encode("latin-1"))
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert "--config" in line and str(config) in line and "not UTF-8" in line and "0xe9" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, text", [("train.lr", "nan"), ("train.lr", "inf"), ("train.lr", "-inf"),
                                       ("train.grad_clip", "inf"), ("train.weight_decay", "nan"),
                                       ("model.norm_eps", "nan"), ("run.collective_timeout_s", "inf"),
                                       ("checkpoint.mtbf_hours", "inf")])
def test_float_options_must_be_finite(key, text):
    from threefold.config import load_config
    from threefold.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={text}"]).validate(1)
    assert str(err.value) == f"{key}: must be a finite number, got {float(text)}"


def test_lr_inf_from_the_command_line_and_nan_from_toml_exit_2(tmp_path, capsys, alone):
    from threefold.cli import main

    assert main(["train", "--lr", "inf", "--steps", "2", "--no-progress", "--out", str(tmp_path / "a")]) == 2
    assert _one_error_line(capsys) == "threefold: error: train.lr: must be a finite number, got inf"
    (tmp_path / "c.toml").write_text("[train]\nlr = nan\n")
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "b")]) == 2
    assert _one_error_line(capsys) == "threefold: error: train.lr: must be a finite number, got nan"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_read_only_run_directory_is_one_line(tmp_path, monkeypatch, capsys):
    from threefold.cli import main
    from threefold.train import rundir

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path.with_name(f".{path.name}.1234")))

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(rundir, "_write_atomic", read_only)  # as on a read-only mount (root ignores chmod)
    assert main(["train", "--steps", "2", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"threefold: error: run.out: cannot write the run directory '{tmp_path / 'run'}/")
    assert "Read-only file system" in line and "--out" in line, line


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_runs_latest_that_is_not_a_link_is_refused(kind, tmp_path, monkeypatch):
    from threefold.config import load_config
    from threefold.train import rundir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    if kind == "file":
        (tmp_path / "runs" / "latest").write_text("notes")
    else:
        (tmp_path / "runs" / "latest").mkdir()
    with pytest.raises(UserError) as err:
        rundir.claim(load_config(None, []))
    assert str(err.value) == (f"run.out: 'runs/latest' is a {kind}, not the link to the newest run that threefold "
                              "keeps there; move it away, or pass --out")
    assert os.listdir(tmp_path / "runs") == ["latest"]  # nothing created, nothing replaced


@pytest.mark.parametrize("option, value", [("--rdzv-timeout", "nan"), ("--rdzv-timeout", "inf"),
                                           ("--rdzv-last-call", "inf"), ("--rdzv-last-call", "0")])
def test_rendezvous_seconds_must_be_finite(option, value, tmp_path, capsys):
    from threefold.cli import main

    assert main(["train", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "localhost:1", option, value,
                 "--out", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert line == f"threefold: error: {option}: must be a finite number of seconds above 0, got {float(value)}"
