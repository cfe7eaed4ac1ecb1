"""A step whose loss or gradient norm is not finite is never saved: the due save (the final one
included) is refused with one line naming the step and the origin, the previous checkpoint stays the
newest, the next finite step saves; a preemption on such a step saves nothing and says so. The NaN
comes from the fault injector (fault.kind=nan: one module's output on one rank)."""

import contextlib
import io
import signal

from tests.helpers import make_config
from threefold.checkpoint.format import step_dir_name
from threefold.checkpoint.verify import verify
from threefold.checkpoint.writer import complete_checkpoints

QUICK = ["model.preset=tiny", "model.layers=1", "train.global_batch=4", "train.seq_len=8", "parallel.dp=2"]


def run_capturing(overrides: list[str], out: str, stop_first: bool = False) -> dict:
    """Train; return rank 0's stderr, the steps of the complete checkpoints, the records' losses and,
    when the run stopped on a (pretended) signal, the checkpoint it names."""
    from threefold.train.preempt import Preempted
    from threefold.train.trainer import Trainer

    err, stopped = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        if stop_first:
            trainer.stop.first = signal.SIGTERM  # as if SIGTERM arrived before step 1: the world stops after it
        try:
            records = trainer.run()
        except Preempted as e:
            records, stopped = [], str(e.checkpoint)
    steps = [int(p.name.split("-")[1]) for p in complete_checkpoints(trainer.checkpointer.root)]
    return {"stderr": err.getvalue(), "steps": steps, "losses": [r["loss"] for r in records], "stopped": stopped}


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_a_nan_on_the_final_save_step_keeps_the_previous_checkpoint_newest(worlds, tmp_path):
    results = worlds(2).run(run_capturing, [*QUICK, "train.steps=4", "checkpoint.save_every=2", "fault.kind=nan",
                                            "fault.rank=1", "fault.step=4", "fault.module=blocks.0.mlp.up"],
                            str(tmp_path))
    out = results[0]
    assert out["steps"] == [2], out  # step 4 (the final save) was refused
    lines = _lines(out["stderr"], "not saved")
    assert len(lines) == 1, out["stderr"]
    assert lines[0].startswith("threefold: step 4 not saved: non-finite loss nan"), lines
    assert "debug.nan_check=true" in lines[0] and str(tmp_path / "checkpoints" / step_dir_name(2)) in lines[0]
    assert not _lines(results[1]["stderr"], "not saved")  # one line for the world, from rank 0
    manifest, problems = verify(tmp_path / "checkpoints" / step_dir_name(2))
    assert not problems and manifest.step == 2


def test_a_refused_save_names_the_module_and_the_next_finite_step_saves(worlds, tmp_path):
    results = worlds(2).run(run_capturing, [*QUICK, "train.steps=4", "checkpoint.save_every=2", "fault.kind=nan",
                                            "fault.rank=1", "fault.step=2", "fault.module=blocks.0.mlp.up",
                                            "debug.nan_check=true"], str(tmp_path))
    out = results[0]
    lines = _lines(out["stderr"], "not saved")
    assert len(lines) == 1 and lines[0].startswith("threefold: step 2 not saved: non-finite loss nan"), out["stderr"]
    assert "first on rank 1 in module blocks.0.mlp.up" in lines[0]
    assert "the newest checkpoint stays none (nothing saved yet)" in lines[0]
    assert out["steps"] == [3, 4], out  # the refused save is made by step 3, the first finite step after it
    for step in out["steps"]:
        assert not verify(tmp_path / "checkpoints" / step_dir_name(step))[1]


def test_a_preemption_on_a_nan_step_saves_nothing_and_says_so(worlds, tmp_path):
    results = worlds(2).run(run_capturing, [*QUICK, "train.steps=4", "fault.kind=nan", "fault.rank=0",
                                            "fault.step=1", "fault.module=blocks.0.mlp.up"], str(tmp_path),
                            stop_first=True)
    out = results[0]
    assert out["steps"] == [], out
    assert len(_lines(out["stderr"], "step 1 not saved")) == 1, out["stderr"]
    stop = _lines(out["stderr"], "SIGTERM at step 1")
    assert len(stop) == 1 and "saved nothing (the step is not finite)" in stop[0], out["stderr"]


def test_a_finite_run_saves_as_before(worlds, tmp_path):
    out = worlds(2).run(run_capturing, [*QUICK, "train.steps=4", "checkpoint.save_every=2"], str(tmp_path))[0]
    assert out["steps"] == [2, 4] and not _lines(out["stderr"], "not saved"), out
