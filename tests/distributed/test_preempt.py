"""A stop signal on one rank stops the whole world at one step boundary (gloo): the flag rides the
step's loss all-reduce, over tp too, and a step launched before the flag was read still finishes."""

import contextlib
import io
import json
import signal

from tests.helpers import make_config
from threefold.checkpoint import verify
from threefold.checkpoint.format import step_dir_name
from threefold.train.preempt import Preempted, StopSignals

BASE = ["model.preset=tiny", "train.steps=8", "train.global_batch=8", "train.seq_len=32",
        "run.collective_timeout_s=30"]


class StopFromRead(StopSignals):
    """A stop request that appears on `rank` at its `n`-th read (the trainer reads it once per step
    it launches), as a signal arriving between two steps would."""

    def __init__(self, rank: int, n: int):
        self.rank, self.n, self.reads = rank, n, 0
        super().__init__()

    @property
    def first(self):
        import torch.distributed as dist

        self.reads += 1
        return signal.SIGTERM if dist.get_rank() == self.rank and self.reads >= self.n else None

    @first.setter
    def first(self, value):
        pass


def stop_task(overrides: list[str], out: str, fake: tuple[int, int] | None) -> dict:
    from threefold.train.trainer import Trainer

    stop = StopSignals() if fake is None else StopFromRead(*fake)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), stop.watching():
        trainer = Trainer(make_config(overrides, out), stop)
        try:
            records = trainer.run()
        except Preempted as stopped:
            return {"step": stopped.step, "signal": stopped.signal_name, "checkpoint": str(stopped.checkpoint),
                    "stderr": err.getvalue()}
    return {"step": None, "steps": len(records), "stderr": err.getvalue()}


def test_a_signal_to_one_tp_rank_stops_both_at_its_step(worlds, tmp_path):
    """tp=2: the loss all-reduce (pp, dp) alone would leave rank 0 out; the flag goes over tp as well."""
    overrides = BASE + ["parallel.tp=2", "fault.rank=1", "fault.step=3", "fault.kind=signal_rank"]
    results = worlds(2).run(stop_task, overrides, str(tmp_path), None)
    assert [r["step"] for r in results] == [3, 3], results
    assert [r["signal"] for r in results] == ["a stop signal to another rank", "SIGTERM"]
    ckpt = tmp_path / "checkpoints" / step_dir_name(3)
    assert results[0]["checkpoint"] == str(ckpt) and verify(ckpt)[1] == []
    assert "SIGTERM at step 3" not in results[0]["stderr"] and "at step 3: saved" in results[0]["stderr"]


def test_a_stop_read_after_the_next_step_was_launched_stops_after_that_step(worlds, tmp_path):
    """dp=2, nothing due: step 2's figures are read after step 3 is launched, so the world stops after
    step 3 - every rank at the same step - and saves it."""
    results = worlds(2).run(stop_task, BASE + ["parallel.dp=2"], str(tmp_path), (1, 2))
    assert [r["step"] for r in results] == [3, 3], results
    assert verify(tmp_path / "checkpoints" / step_dir_name(3))[1] == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [step_dir_name(3)]
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]  # step 3's figures are read and logged before the stop
