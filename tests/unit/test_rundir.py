"""A run directory belongs to one run; inputs that would fail late exit 2 with one line at once."""

import json
import os

import numpy as np
import pytest

from threefold.checkpoint.writer import prune
from threefold.cli import main
from threefold.config import load_config
from threefold.errors import UserError
from threefold.train import rundir


def claim(out, *overrides, overwrite=False):
    """Claim `out` as a run that then ends (its lock released)."""
    cfg, lock = rundir.claim(load_config(None, [f"run.out={out}", *overrides]), overwrite)
    lock.release()
    return cfg


def finished_run(out):
    """A directory as a finished run leaves it: run file, metrics, a checkpoint."""
    cfg = claim(out)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    manifest = {"config": {"model": cfg.to_dict()["model"], "run": {"id": cfg.run.id}}}
    (out / "checkpoints" / "step-00000001" / "manifest.json").write_text(json.dumps(manifest))
    return cfg


def test_a_new_run_in_another_runs_directory_exits_with_the_choices(tmp_path):
    first = finished_run(tmp_path / "run")
    with pytest.raises(UserError) as err:
        claim(tmp_path / "run")
    text = str(err.value)
    assert text.startswith("run.out:") and str(tmp_path / "run") in text and first.run.id in text
    assert "--resume auto" in text and "new --out" in text and "--overwrite" in text
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched


def test_resume_auto_continues_only_a_run_of_the_same_model(tmp_path):
    first = finished_run(tmp_path / "run")
    assert claim(tmp_path / "run", "checkpoint.resume=auto").run.id == first.run.id
    with pytest.raises(UserError) as err:
        claim(tmp_path / "run", "checkpoint.resume=auto", "model.layers=3")
    assert "another model" in str(err.value) and str(tmp_path / "run") in str(err.value)


def test_stale_checkpoints_of_another_model_are_refused_without_a_run_file(tmp_path):
    first = finished_run(tmp_path / "run")
    (tmp_path / "run" / "run.json").unlink()  # a directory from before run files
    with pytest.raises(UserError) as err:
        claim(tmp_path / "run", "checkpoint.resume=auto", "model.hidden=64")
    assert "step-00000001" in str(err.value) and "another model" in str(err.value)
    # the same model adopts the directory, as the run its checkpoints name (so --resume auto takes them)
    assert claim(tmp_path / "run", "checkpoint.resume=auto").run.id == first.run.id


def test_overwrite_moves_the_old_run_aside_and_keeps_its_files(tmp_path):
    first = finished_run(tmp_path / "run")
    second = claim(tmp_path / "run", overwrite=True)
    (moved,) = tmp_path.glob("run.old-*")
    assert json.loads((moved / "run.json").read_text())["run_id"] == first.run.id
    assert (moved / "metrics.jsonl").exists() and (moved / "checkpoints" / "step-00000001" / "manifest.json").exists()
    assert second.run.id != first.run.id and sorted(os.listdir(tmp_path / "run")) == [".lock", "run.json"]


def test_default_out_is_a_fresh_directory_linked_from_latest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = claim("")
    (tmp_path / a.run.out / "metrics.jsonl").write_text("")
    b = claim("")
    assert a.run.out != b.run.out and a.run.out.startswith("runs/") and b.run.out.startswith("runs/")
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / b.run.out).resolve()
    (tmp_path / b.run.out / "metrics.jsonl").write_text("")
    again = claim("runs/latest", "checkpoint.resume=auto")  # --out runs/latest continues the run it points at
    assert again.run.id == b.run.id and again.run.out == str((tmp_path / b.run.out).resolve())
    moved = claim("runs/latest", overwrite=True)
    assert moved.run.id != b.run.id and (tmp_path / "runs" / "latest").resolve() == (tmp_path / b.run.out).resolve()


def test_retention_prunes_only_checkpoints_of_the_same_run(tmp_path):
    for step, run_id in [(1, "old"), (2, "old"), (3, "new"), (4, "new"), (5, "new")]:
        ckpt = tmp_path / f"step-{step:08d}"
        ckpt.mkdir()
        (ckpt / "manifest.json").write_text(json.dumps({"config": {"run": {"id": run_id}}}))
    prune(tmp_path, keep=2, run_id="new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002", "step-00000004",
                                                          "step-00000005"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("x" * 20)
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.int64))
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path


@pytest.mark.parametrize("args, words", [
    (["--out", "{tmp}/a-file"], ["run.out:", "a-file", "is a file"]),
    (["--data", "{tmp}/empty.txt"], ["data.source:", "empty.txt", "is empty", "34 tokens"]),
    (["--data", "{tmp}/short.txt"], ["data.source:", "short.txt", "holds 20 tokens", "seq_len + 2 = 34"]),
    (["--data", "{tmp}/short.npy"], ["data.source:", "short.npy", "holds 10 tokens"]),
    (["--nproc", "0"], ["--nproc: 0 is not a number of processes", "1 or more"]),
    (["--nproc", "-1"], ["--nproc: -1 is not a number of processes"]),
])
def test_bad_inputs_exit_2_with_one_line(args, words, files, capsys):
    args = [a.replace("{tmp}", str(files)) for a in args]
    out = ["--out", str(files / "run")] if "--out" not in args else []
    assert main(["train", "--steps", "2", "--no-progress", *out, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threefold: error: "), err
    assert all(w in err[0] for w in words), err[0]
    assert not (files / "run").exists()  # nothing claimed for a run that never started


def test_the_model_hash_ignores_how_the_loss_is_computed():
    """model.loss_chunk changes no weight: a run resumes with another value, and a run.json written
    before the key existed still matches."""
    from threefold.config import load_config
    from threefold.train.rundir import model_hash

    model = load_config(None, []).to_dict()["model"]
    older = {k: v for k, v in model.items() if k != "loss_chunk"}
    assert model_hash(model) == model_hash(older) == model_hash({**model, "loss_chunk": 64})
    assert model_hash(model) != model_hash({**model, "vocab": 512})


def test_keys_added_later_leave_the_hash_of_older_runs_alone():
    """A run.json written before model.router_balance and model.mtp_* existed still names the same run while
    they are at their defaults; set away from them they make another run."""
    from threefold.config import load_config
    from threefold.train.rundir import ADDED_LATER, model_hash

    model = load_config(None, []).to_dict()["model"]
    assert {k: model[k] for k in ADDED_LATER} == ADDED_LATER  # the defaults as the config has them
    older = {k: v for k, v in model.items() if k not in ADDED_LATER}
    assert model_hash(model) == model_hash(older)
    assert model_hash({**model, "mtp_depth": 1}) != model_hash(model)
    assert model_hash({**model, "router_balance": "bias"}) != model_hash(model)


def test_a_running_run_holds_its_directory_until_it_ends(tmp_path):
    out = tmp_path / "run"
    cfg, lock = rundir.claim(load_config(None, [f"run.out={out}"]))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with lock:
        for overwrite in (False, True):
            with pytest.raises(UserError) as err:
                claim(out, overwrite=overwrite)
            assert f"pid {os.getpid()}" in str(err.value) and "still running" in str(err.value)
        assert not list(tmp_path.glob("run.old-*"))  # --overwrite moved nothing while the run runs
    assert claim(out, "checkpoint.resume=auto").run.id == cfg.run.id  # once it ended, it can be continued


def test_a_removed_lock_file_frees_nothing_while_the_run_runs(tmp_path):
    """`rm DIR/.lock` under a running run: a new run, --overwrite too, still exits 2 naming the holder
    (from the kernel's lock table, the file that named it being gone), and nothing is moved."""
    import socket

    out = tmp_path / "run"
    cfg, lock = rundir.claim(load_config(None, [f"run.out={out}"]))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".lock").unlink()
    with lock:
        for overwrite in (True, False, True):  # the second try meets the .lock file the first one created
            with pytest.raises(UserError) as err:
                claim(out, overwrite=overwrite)
            text = str(err.value)
            assert f"(host {socket.gethostname()}, pid {os.getpid()}, whose .lock was removed)" in text, text
            assert text.startswith(f"run.out: '{out}' is in use by a run that is still running"), text
            assert ("--overwrite moves aside only a run that has ended" in text) == overwrite, text
        assert not list(tmp_path.glob("run.old-*")) and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
        assert json.loads((out / "run.json").read_text())["run_id"] == cfg.run.id
    claim(out, overwrite=True)  # the run ended: now it is moved aside
    assert len(list(tmp_path.glob("run.old-*"))) == 1


def test_the_holder_named_is_the_one_holding_the_lock_not_an_earlier_one(tmp_path):
    """Between taking the lock and writing its host and pid, a new holder's lock file still holds
    what an earlier holder left: a second run started in that moment waits for the new lines."""
    import fcntl
    import socket
    import subprocess
    import sys
    import threading

    out = tmp_path / "run"
    rundir.lock_directory(out).release()
    assert (out / ".lock").read_text() == ""  # a run that ended cleanly leaves no holder named
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"host": socket.gethostname(), "pid": int(gone.stdout), "started": "earlier"}
    (out / ".lock").write_text(json.dumps(stale) + "\n")  # what a killed holder leaves
    fd = os.open(out / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the new holder, which has not written yet
    new = {"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}
    writes = threading.Timer(0.3, lambda: (os.ftruncate(fd, 0), os.pwrite(fd, (json.dumps(new) + "\n").encode(), 0)))
    writes.start()
    try:
        with pytest.raises(UserError) as err:
            rundir.lock_directory(out)
    finally:
        writes.join()
        os.close(fd)
    assert f"pid {os.getpid()}, since now" in str(err.value), str(err.value)


def test_every_model_field_changes_the_function_but_the_documented_ones():
    """A field added to ModelConfig is compared by a resume unless it is listed, with its reason."""
    from dataclasses import fields

    from threefold.config.sections import ModelConfig

    names = {f.name for f in fields(ModelConfig)}
    assert set(rundir.NOT_FUNCTION) <= names and all(rundir.NOT_FUNCTION.values())
    assert set(rundir.FUNCTION_FIELDS) == names - set(rundir.NOT_FUNCTION)
    for key in ("hidden", "heads", "kv_heads", "norm_eps", "position", "rope_theta", "mlp", "norm",
                "tie_embeddings", "vocab", "experts", "experts_top_k", "head_size", "bias"):
        assert key in rundir.FUNCTION_FIELDS, key


def test_a_resume_takes_only_its_own_runs_state_or_the_same_models(tmp_path):
    cfg = load_config(None, [f"run.out={tmp_path}", "run.id=aaaa", "checkpoint.resume=auto"])
    model = cfg.to_dict()["model"]
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    rundir.check_resume(ckpt, {"model": model, "run": {"id": "aaaa"}}, cfg)
    rundir.check_resume(ckpt, {"model": model, "run": {"id": ""}}, cfg)  # written before run ids
    with pytest.raises(UserError) as err:
        rundir.check_resume(ckpt, {"model": model, "run": {"id": "bbbb"}}, cfg)
    assert "belongs to run bbbb, not to run aaaa" in str(err.value) and str(ckpt) in str(err.value)
    explicit = load_config(None, [f"run.out={tmp_path}", "run.id=aaaa", f"checkpoint.resume={tmp_path}"])
    rundir.check_resume(ckpt, {"model": model, "run": {"id": "bbbb"}}, explicit)  # another run, the same model
    # how the loss is computed, the initial values and the loss weights are no part of the function
    rundir.check_resume(ckpt, {"model": {**model, "loss_chunk": 8, "init_std": 1.0, "router_aux_weight": 0.5}},
                        explicit)
    older = {k: v for k, v in model.items() if k != "vocab_multiple"}  # a field the writer did not have yet
    rundir.check_resume(ckpt, {"model": older}, explicit)
    with pytest.raises(UserError) as err:
        rundir.check_resume(ckpt, {"model": {**model, "heads": 8, "norm_eps": 0.1}}, explicit)
    text = str(err.value)
    assert "heads 8 -> 4" in text and "norm_eps 0.1 -> 1e-05" in text and "checkpoint.init_from" in text, text
    with pytest.raises(UserError, match="does not say which model"):
        rundir.check_resume(ckpt, {}, explicit)
