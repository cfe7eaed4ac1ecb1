"""One run per directory, while it runs; a resume takes only its own run's state.

The concurrent starts go through the `threefold train` command's own code (options, config,
checks, the claim of the run directory) in child processes released at the same instant; the
training itself is replaced by a wait, so twenty tries cost a fraction of a second each. One
pair of real runs and the resumes then run the whole command.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from tests.e2e.cli import SRC, threefold

QUICK = ["--model", "tiny", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress"]

# A child that starts `threefold train` once per line it reads ({"out": DIR, "args": [...]}) and
# answers one JSON line per start: {"won": pid} when it holds DIR (its training is a wait for the
# next line), then {"rc": code, "err": its stderr} when the command ended.
CHILD = r"""
import contextlib, io, json, os, sys
from threefold.cli import main
from threefold.train import command

def hold(cfg, worker=False):
    print(json.dumps({"won": os.getpid()}), flush=True)
    sys.stdin.readline()

command._train = hold
for line in sys.stdin:
    order = json.loads(line)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train", "--no-progress", "--out", order["out"], *order["args"]])
    print(json.dumps({"rc": rc, "err": err.getvalue()}), flush=True)
"""


class Child:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def start(self, out, *args: str) -> None:
        self.send(json.dumps({"out": str(out), "args": list(args)}))

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"child {self.proc.pid} ended (exit {self.proc.wait()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def children():
    made = []

    def make():
        made.append(Child())
        return made[-1]

    yield make
    for child in made:
        child.close()


def holder_named(line: str, pid: int) -> bool:
    return f"host {socket.gethostname()}, pid {pid}," in line


def test_two_runs_started_at_once_into_one_directory_exactly_one_wins(children, tmp_path):
    a, b = children(), children()
    for attempt in range(20):
        # a fresh directory (both create it), or one that earlier tries used (its lock file is left)
        out = tmp_path / (f"fresh-{attempt}" if attempt % 2 else "reused")
        args = ["--resume", "auto"] if attempt % 4 == 2 else []
        a.start(out, *args)
        b.start(out, *args)
        answers = {"a": a.answer(), "b": b.answer()}
        winners = [name for name, ans in answers.items() if "won" in ans]
        assert len(winners) == 1, f"try {attempt}: {answers}"
        winner, loser = (a, b) if winners == ["a"] else (b, a)
        lost = answers["b" if winners == ["a"] else "a"]
        lines = lost["err"].strip().splitlines()
        assert lost["rc"] == 2 and len(lines) == 1, f"try {attempt}: {lost}"
        assert lines[0].startswith(f"threefold: error: run.out: '{out}' is in use by a run that is still running")
        assert holder_named(lines[0], winner.proc.pid), lines[0]
        winner.send("done")
        assert winner.answer() == {"rc": 0, "err": ""}
        assert json.loads((out / "run.json").read_text())["run_id"]


def test_overwrite_refuses_while_the_run_runs_and_a_killed_run_leaves_no_lock(children, tmp_path):
    out = tmp_path / "run"
    holder = children()
    holder.start(out)
    assert holder.answer() == {"won": holder.proc.pid}
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # what the running run has written so far
    for args in (["--overwrite"], [], ["--resume", "auto"]):
        run = threefold("train", *QUICK, "--out", str(out), *args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert holder_named(lines[0], holder.proc.pid) and f"'{out}' is in use" in lines[0], lines[0]
        if args:
            assert ("--overwrite moves aside only a run that has ended" in lines[0]) == (args == ["--overwrite"])
    assert not list(tmp_path.glob("run.old-*")) and (out / "metrics.jsonl").exists()  # nothing moved
    os.kill(holder.proc.pid, signal.SIGKILL)  # the kernel drops the lock of a dead holder
    holder.proc.wait()
    after = children()
    after.start(out, "--overwrite")
    assert after.answer() == {"won": after.proc.pid}
    assert len(list(tmp_path.glob("run.old-*"))) == 1  # the killed run was moved aside, not deleted
    assert json.loads((out / ".lock").read_text())["pid"] == after.proc.pid


def test_removing_the_lock_file_frees_nothing_while_the_run_runs(children, tmp_path):
    """`rm DIR/.lock` while a run runs, then `--overwrite`: exit 2 naming the running process, nothing
    moved; the running run ends as it would have, and only then is it moved aside."""
    out = tmp_path / "run"
    holder, other = children(), children()
    holder.start(out)
    assert holder.answer() == {"won": holder.proc.pid}
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".lock").unlink()
    for args in (["--overwrite"], ["--resume", "auto"]):
        other.start(out, *args)
        refused = other.answer()
        assert "won" not in refused, f"{args} took the directory of the running run"
        lines = refused["err"].strip().splitlines()
        assert refused["rc"] == 2 and len(lines) == 1, refused
        assert holder_named(lines[0], holder.proc.pid) and "whose .lock was removed" in lines[0], lines[0]
    assert not list(tmp_path.glob("run.old-*")) and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    holder.send("done")
    assert holder.answer() == {"rc": 0, "err": ""}
    other.start(out, "--overwrite")
    assert other.answer() == {"won": other.proc.pid}
    assert [json.loads((p / "metrics.jsonl").read_text()) for p in tmp_path.glob("run.old-*")] == [{"step": 1}]
    other.send("done")
    ended = other.answer()
    assert ended["rc"] == 0 and ended["err"].startswith(f"threefold: moved the previous run in {out} to"), ended


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two real runs started at once into one directory: one trains (saving at step 2), the other
    exits 2 at once naming it."""
    root = tmp_path_factory.mktemp("lock")
    out = root / "run"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "threefold", "train", *QUICK, "--save-every", "2", "--out", str(out)]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [(p.pid, *p.communicate(timeout=600), p.returncode) for p in runs]
    return root, out, results


def test_two_real_runs_at_once_one_trains_the_other_exits_2(trained):
    root, out, results = trained
    (won,) = [r for r in results if r[3] == 0]
    (lost,) = [r for r in results if r[3] != 0]
    lines = lost[2].strip().splitlines()
    assert lost[3] == 2 and len(lines) == 1 and holder_named(lines[0], won[0]), lost[2]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    manifest = json.loads((out / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["config"]["run"]["id"] == run_id  # the checkpoint names the run that wrote it


def test_resume_auto_refuses_another_runs_checkpoint(trained):
    from threefold.config import load_config
    from threefold.train.rundir import model_hash

    root, out, _ = trained
    other = root / "other"  # a run of the same model, into whose directory run's checkpoint was copied
    (other / "checkpoints").mkdir(parents=True)
    model = load_config(None, ["model.preset=tiny"]).to_dict()["model"]
    (other / "run.json").write_text(json.dumps({"run_id": "0123456789ab", "config_hash": model_hash(model)}))
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    shutil.copytree(out / "checkpoints" / "step-00000002", other / "checkpoints" / "step-00000002")
    theirs = json.loads((out / "run.json").read_text())["run_id"]
    run = threefold("train", *QUICK, "--steps", "3", "--resume", "auto", "--out", str(other))
    lines = [line for line in run.stderr.strip().splitlines() if line.startswith("threefold: error:")]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"belongs to run {theirs}, not to run 0123456789ab" in lines[0] and "Traceback" not in run.stderr, lines
    assert (other / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing trained


def test_resume_path_refuses_a_checkpoint_of_another_model_and_names_the_fields(trained):
    root, out, _ = trained
    ckpt = out / "checkpoints" / "step-00000002"
    run = threefold("train", *QUICK, "--steps", "3", "--resume", str(ckpt), "--out", str(root / "other-model"),
                    "--set", "model.heads=8", "--set", "model.kv_heads=8", "--set", "model.norm_eps=0.1")  # same shapes
    lines = [line for line in run.stderr.strip().splitlines() if line.startswith("threefold: error:")]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "heads 4 -> 8" in lines[0] and "norm_eps 1e-05 -> 0.1" in lines[0], lines[0]
    assert "kv_heads 4 -> 8" in lines[0] and "checkpoint.init_from" in lines[0], lines[0]
    assert not (root / "other-model" / "metrics.jsonl").exists()
