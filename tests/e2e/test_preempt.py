"""Preemption through the CLI: a stop signal saves the step it arrives at, exits 3 (PREEMPTED_EXIT),
and `--resume auto` continues bitwise; a second SIGINT stops at once (130).

The signal comes from the `signal` fault (observe/faults.py): at the start of step k, rank 1
signals the launcher and waits until the launcher's forward has reached it, so the world stops
at step k whatever the machine's load; k is drawn per signal from a fixed seed.
"""

import json
import random
from pathlib import Path

import pytest

from tests.e2e.cli import threefold
from threefold.checkpoint.format import step_dir_name
from threefold.cli import main
from threefold.train.preempt import INTERRUPTED_EXIT, PREEMPTED_EXIT

STEPS = 6
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--seq-len", "32", "--deterministic",
          "--save-every", "2", "--async-save", "--no-progress", "--set", "run.plot=false",
          "--set", "run.collective_timeout_s=60"]
LAUNCH = ["train", "--nproc", "2", "--max-restarts", "2", "--resume", "auto", *COMMON]


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def fault(kind: str, signals: str, step: int, rank: int = 1) -> list[str]:
    return ["--set", f"fault.rank={rank}", "--set", f"fault.step={step}", "--set", f"fault.kind={kind}",
            "--set", f"fault.signal={signals}"]


def stop_step(name: str) -> int:
    return random.Random(name).randint(2, STEPS - 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted 2-process run."""
    out = tmp_path_factory.mktemp("preempt") / "reference"
    run = threefold(*LAUNCH, "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return losses(out)


def check_stopped(run, out: Path, step: int, who: str, capsys) -> None:
    """Exit 3, the one line, no restart nor traceback, the checkpoint of `step` complete and verified."""
    ckpt = out / "checkpoints" / step_dir_name(step)
    assert run.returncode == PREEMPTED_EXIT, run.stderr[-3000:]
    line = (f"threefold: {who} at step {step}: saved {ckpt}; exit {PREEMPTED_EXIT} (preempted) - continue with "
            "--resume auto")
    lines = run.stderr.strip().splitlines()
    assert lines.count(line) == 1 and len(lines) <= 2, run.stderr[-3000:]  # and "no checkpoint yet" before it
    assert "Traceback" not in run.stderr and "restarting" not in run.stderr, run.stderr[-3000:]
    assert main(["ckpt", "verify", str(ckpt)]) == 0, capsys.readouterr().out
    assert [s for s, _ in losses(out)] == list(range(1, step + 1))


def test_sigterm_to_the_launcher_saves_that_step_and_resume_auto_continues_bitwise(tmp_path, reference, capsys):
    step, out = stop_step("SIGTERM"), tmp_path / "run"
    stopped = threefold(*LAUNCH, "--out", str(out), *fault("signal", "SIGTERM", step))
    check_stopped(stopped, out, step, "SIGTERM", capsys)
    resumed = threefold(*LAUNCH, "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / step_dir_name(step)}" in resumed.stderr
    assert losses(out) == reference  # every step once, each loss bitwise the uninterrupted run's


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGINT"])
def test_other_stop_signals_to_the_launcher_save_that_step(tmp_path, reference, capsys, name):
    step, out = stop_step(name), tmp_path / "run"
    stopped = threefold(*LAUNCH, "--out", str(out), *fault("signal", name, step))
    check_stopped(stopped, out, step, name, capsys)
    assert losses(out) == reference[:step]


def test_a_signal_to_one_worker_stops_the_world(tmp_path, reference, capsys):
    """As srun signals its tasks, not threefold's launcher: the world agrees through the step's all-reduce
    (rank 0 itself got no signal), and the launcher exits 3 on its workers' word."""
    step, out = stop_step("one worker"), tmp_path / "run"
    stopped = threefold(*LAUNCH, "--out", str(out), *fault("signal_rank", "SIGTERM", step))
    check_stopped(stopped, out, step, "a stop signal to another rank", capsys)


def test_a_second_sigint_to_the_launcher_stops_at_once(tmp_path):
    step, out = 3, tmp_path / "run"
    stopped = threefold(*LAUNCH, "--out", str(out), *fault("signal", "SIGINT,SIGINT", step))
    assert stopped.returncode == INTERRUPTED_EXIT, stopped.stderr[-3000:]
    assert "threefold: SIGINT again: stopped the workers at once, without saving; exit 130" in stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert not (out / "checkpoints" / step_dir_name(step)).exists()
