"""Goodput (observe/goodput.py): where a run's wall time went, per attempt and over the attempts of one
run directory. The breakdown's arithmetic on a written record; then a real run in this process with
injected faults - a data loader that sleeps, an exception after a save (the next attempt resumes from
an older step and recomputes), a stop signal - whose lost seconds the breakdown must find."""

import contextlib
import io
import json
import signal
import time

import pytest

from tests.helpers import make_config
from threefold.cli import main
from threefold.observe.goodput import CATEGORIES, breakdown, read_lines, run_breakdown


def _line(step: int, step_time: float, at: float, **extra) -> dict:
    return {"step": step, "step_time_s": step_time, "data_wait_s": 0.0, "time": at, **extra}


def test_breakdown_of_a_killed_a_preempted_and_a_completed_attempt():
    lost = [_line(4, 2.0, 114.0), _line(5, 2.5, 116.5)]  # attempt 1 ran them; attempt 2 resumed from step 3
    doc = {"attempts": [
        {"attempt": 1, "started_at": 100.0, "startup_s": 2.0, "resumed_step": 0, "outcome": "killed", "lost": lost},
        {"attempt": 2, "started_at": 130.0, "startup_s": 3.0, "resumed_step": 3, "outcome": "preempted",
         "ended_at": 140.0, "preemption_s": 1.0, "checkpoint_s": 0.0},
        {"attempt": 3, "started_at": 150.0, "startup_s": 1.0, "resumed_step": 5, "outcome": "completed",
         "ended_at": 156.0, "checkpoint_s": 0.5}]}
    lines = [_line(1, 5.0, 107.0), _line(2, 2.0, 109.0),  # step 1: 3 s of warm-up over the median 2
             _line(3, 2.0, 112.0, data_wait_s=0.5, save_stall_s=1.0),
             _line(4, 2.0, 135.0, eval_time_s=0.25), _line(5, 2.0, 137.5, save_wait_s=0.5),
             _line(6, 2.0, 153.0), _line(7, 2.0, 155.0)]
    result = breakdown(doc, lines)
    one, two, three = (row["seconds"] for row in result["attempts"])
    # attempt 1: killed, so it ended at its last line (116.5); its steps 4 and 5 were recomputed
    assert result["attempts"][0]["recomputed_steps"] == [4, 5] and one["recomputed"] == 4.5
    assert (one["startup"], one["warmup"], one["productive"], one["data_wait"], one["checkpoint"]) == (2, 3, 5.5, 0.5, 1)
    assert one["restart"] == 130.0 - 116.5 and one["other"] == 0  # the gap to the next start
    assert result["attempts"][0]["wall_s"] == 16.5 + 13.5
    # attempt 2: its startup is a restart's; preempted: the gap after it is the preemption's
    assert two["restart"] == 3.0 and two["preemption"] == 1.0 + 10.0 and two["evaluation"] == 0.25
    # two steps only: the first's warm-up is measured against the median of both (1.75 s of compute)
    assert two["checkpoint"] == 0.5 and two["warmup"] == 0.25 and two["productive"] == 1.75 + 1.5
    assert two["other"] == pytest.approx(10.0 - 3.0 - 1.0 - 4.25)
    # attempt 3: completed and the last: no gap
    assert three["restart"] == 1.0 and three["checkpoint"] == 0.5 and three["productive"] == 4.0
    total = result["total"]
    assert total["wall_s"] == pytest.approx(30.0 + 20.0 + 6.0)
    assert sum(total["seconds"].values()) == pytest.approx(total["wall_s"])
    assert sum(total["fractions"].values()) == pytest.approx(1.0)


SLEEP = 0.2  # the data loader's injected sleep, at steps 2 to 5 of the first attempt
QUICK = ["model.preset=tiny", "model.layers=1", "train.global_batch=2", "train.seq_len=16", "train.steps=6",
         "checkpoint.save_every=3", "data.prefetch=0"]  # the batch is read in the step: its wait is the sleep


def _attempt(out, extra: list[str], sleepy: bool = False, stop_after_first: bool = False):
    from threefold.train.preempt import Preempted
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config([*QUICK, *extra], str(out)))
    if sleepy:
        host = trainer.loader._host

        def slow(step):  # 0-based: steps 2 to 5
            if 1 <= step <= 4:
                time.sleep(SLEEP)
            return host(step)

        trainer.loader._host = slow
    if stop_after_first:
        trainer.stop.first = signal.SIGTERM  # as if SIGTERM arrived: the world stops after its next step
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            trainer.run()
        except (RuntimeError, Preempted) as e:
            return type(e).__name__, err.getvalue()
    return "done", err.getvalue()


def test_lost_seconds_of_a_failure_a_restart_and_a_preemption(tmp_path, alone, monkeypatch, capsys):
    run = tmp_path / "run"
    # attempt 1: saved at step 3, steps 4 and 5 run, an exception at the start of step 6
    assert _attempt(run, ["fault.kind=raise", "fault.rank=0", "fault.step=6"], sleepy=True)[0] == "RuntimeError"
    failed_at = time.time()
    before = {line["step"]: line for line in read_lines(run / "metrics.jsonl")}
    assert sorted(before) == [1, 2, 3, 4, 5]
    assert before[3]["save_stall_s"] > 0 and all("save_stall_s" not in before[s] for s in (1, 2, 4, 5))
    time.sleep(0.3)  # the time the restart costs here (a launcher would notice and start again)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted process: the fault does not fire again
    resume = ["checkpoint.resume=auto"]
    # attempt 2: resumes from step 3, stops on a (pretended) SIGTERM at the next boundary and saves step 5
    assert _attempt(run, resume, stop_after_first=True)[0] == "Preempted"
    stopped_at = time.time()
    time.sleep(0.2)
    status, err = _attempt(run, resume)  # attempt 3: from step 5 to the end
    assert status == "done"
    result = run_breakdown(run)
    one, two, three = result["attempts"]
    assert [a["outcome"] for a in result["attempts"]] == ["failed", "preempted", "completed"]
    assert [one["steps"], two["steps"], three["steps"]] == [[1, 3], [4, 5], [6, 6]]
    # the recomputed steps are those after the checkpoint attempt 2 resumed from, with their recorded times
    # (the same numbers, summed again: equal to rounding), which hold the data loader's sleeps
    assert one["recomputed_steps"] == [4, 5]
    assert one["seconds"]["recomputed"] == pytest.approx(before[4]["step_time_s"] + before[5]["step_time_s"], rel=1e-12)
    assert one["seconds"]["recomputed"] >= 2 * SLEEP
    # the kept steps' data waits hold the sleeps of steps 2 and 3 (0-based 1 and 2), a checkpoint its stall
    assert one["seconds"]["data_wait"] >= 2 * SLEEP and one["seconds"]["checkpoint"] == before[3]["save_stall_s"]
    # from the failure to the next start: at least what this test slept; the preemption's likewise
    assert one["seconds"]["restart"] >= 0.3 and two["seconds"]["preemption"] >= 0.2
    assert two["seconds"]["restart"] > 0 and three["seconds"]["restart"] > 0  # the later attempts' startups
    doc = json.loads((run / "goodput.json").read_text())
    assert doc["attempts"][0]["ended_at"] <= failed_at and doc["attempts"][1]["ended_at"] <= stopped_at
    assert doc["attempts"][1]["preemption_s"] > 0  # the save on the stop signal
    total = result["total"]
    assert sum(total["seconds"].values()) == pytest.approx(total["wall_s"], rel=1e-9)
    assert total["wall_s"] >= 0.3 + 0.2 + 4 * SLEEP
    assert doc["summary"]["wall_s"] == pytest.approx(total["wall_s"])  # written at attempt 3's end
    done = next(line for line in err.splitlines() if line.startswith("threefold: done: "))
    assert "; goodput " in done and "(3 attempts)" in done and " recomputed " in done, done
    # the command: a table and JSON, the same figures
    capsys.readouterr()
    assert main(["runs", "goodput", str(run), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"]["seconds"] == pytest.approx(total["seconds"])
    assert main(["runs", "goodput", str(run)]) == 0
    text = capsys.readouterr().out
    assert "#1: failed, steps 1-3, steps 4-5 recomputed by the next" in text and "#3: completed, steps 6-6" in text
    assert all(label in text for label in ("productive", "data wait", "recomputed", "restart", "preemption"))


def test_runs_goodput_without_a_record_is_one_line(tmp_path, capsys):
    assert main(["runs", "goodput", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "goodput.json' does not exist" in err[0], err


def test_every_category_is_labelled():
    from threefold.observe.goodput import LABELS

    assert set(LABELS) == set(CATEGORIES)


def test_runs_goodput_starts_without_torch(tmp_path):
    from tests.unit.test_cli_startup import modules_after

    (tmp_path / "goodput.json").write_text(json.dumps({"version": 1, "attempts": [
        {"attempt": 1, "started_at": 1.0, "startup_s": 0.5, "resumed_step": 0, "outcome": "completed", "ended_at": 3.0}]}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_line(1, 1.0, 2.5)) + "\n")
    assert modules_after(["runs", "goodput", str(tmp_path)], ["runs", "goodput", str(tmp_path), "--json"]) == "[]"


SNAPSHOT_S = 2.0  # an async save's snapshot made this slow: the next update waits for it, so does the end


def test_the_blocking_part_of_async_saves_is_checkpoint_time(tmp_path, alone, monkeypatch):
    import threefold.checkpoint.checkpointer as checkpointer_module
    from threefold.train.trainer import Trainer

    snapshot = checkpointer_module.snapshot

    def slow_snapshot(*args, **kwargs):
        time.sleep(SNAPSHOT_S)
        return snapshot(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "snapshot", slow_snapshot)
    run = tmp_path / "run"
    with contextlib.redirect_stderr(io.StringIO()):
        Trainer(make_config([*QUICK, "train.steps=3", "checkpoint.save_every=2", "checkpoint.async_save=true"],
                            str(run))).run()
    lines = {line["step"]: line for line in read_lines(run / "metrics.jsonl")}
    doc = json.loads((run / "goodput.json").read_text())["attempts"][0]
    # step 3's update waited for step 2's snapshot (inside its step time); the end waited for step 3's
    assert 0 < lines[3]["save_wait_s"] <= lines[3]["step_time_s"] and "save_wait_s" not in lines[2]
    assert lines[3]["step_time_s"] >= SNAPSHOT_S * 0.9  # it began as the snapshot did, and its update waited for its end
    assert doc["checkpoint_s"] >= SNAPSHOT_S * 0.9  # the whole snapshot of step 3, less the host work before the end
    seconds = run_breakdown(run)["attempts"][0]["seconds"]
    expected = lines[2]["save_stall_s"] + lines[3]["save_stall_s"] + lines[3]["save_wait_s"] + doc["checkpoint_s"]
    assert seconds["checkpoint"] == pytest.approx(expected, rel=1e-12)
