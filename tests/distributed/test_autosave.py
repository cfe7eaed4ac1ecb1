"""`--save-every auto` in a real run: the saves fall where the advice from the measured costs says."""

import json
import statistics

from tests.helpers import make_config
from threefold.planner.checkpoint_interval import advise

# a job MTBF of 0.09 s (2 GPUs): with the tiny model's ~0.01-0.03 s steps and saves the advice is a
# few steps, so the saves between the first (step 2) and the last (step 12) follow it
MTBF_HOURS = 0.00005
BASE = ["model.preset=tiny", "train.steps=12", "train.global_batch=8", "train.seq_len=32",
        "checkpoint.save_every=auto", "checkpoint.keep=0", "checkpoint.restart_seconds=1",
        f"checkpoint.mtbf_hours={MTBF_HOURS}"]


def autosave_task(out: str) -> dict:
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(BASE, out))
    records = trainer.run()
    return {"step_times": [r["step_time_s"] for r in records], "history": trainer.autosave.history}


def test_save_every_auto_saves_at_the_advised_steps(worlds, tmp_path):
    results = worlds(2).run(autosave_task, str(tmp_path))
    history = results[0]["history"]
    assert all(r["history"] == history for r in results)  # the ranks agreed
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").iterdir())
    assert saved == [step for step, _ in history] and saved[0] == 2 and saved[-1] == 12
    for (step, every), (following, _) in zip(history, history[1:]):
        assert following == min(step + every, 12)
    entry = json.loads((tmp_path / "run.json").read_text())["checkpoint_interval"]
    measured = entry["measured"]
    assert measured["at_step"] == 12 and measured["saves"] == len(saved)
    # the step time is the slowest rank's median of its steps after the first (the metrics' own figures)
    assert measured["step_s"] == max(statistics.median(r["step_times"][1:12]) for r in results)
    expected = advise(measured["save_s"], MTBF_HOURS, 2, 1.0, step_s=measured["step_s"])
    assert entry["every_steps"] == expected.every_steps == history[-1][1]
    assert entry["gpus"] == 2 and 0 < measured["save_s"] < 60
