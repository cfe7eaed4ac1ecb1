"""save_every=auto: which measured costs reach the Young/Daly advice, and when the saves fall."""

import math

from threefold.config import load_config
from threefold.train.autosave import AutoSave


def test_auto_interval_from_the_slowest_rank_without_warm_up():
    ck = load_config(None, ["checkpoint.save_every=auto", "checkpoint.mtbf_hours=0.5",
                            "checkpoint.restart_seconds=0"]).checkpoint
    other_rank = [3.0, 1.25]  # another rank's save stall and step time: the slower save, the faster step
    auto = AutoSave(ck, gpus=4, last_step=40, start_step=0,
                    agree=lambda mine: [max(a, b) for a, b in zip(mine, other_rank)])
    steps = []
    for step, elapsed in enumerate([30.0] + [1.5] * 39, 1):  # step 1 carries a 30 s warm-up
        auto.record_step(elapsed)
        if auto.due(step):
            steps.append(step)
            auto.after_save(step, 2.0)
    # save 3 s (the other rank's), step 1.5 s (this rank's median, warm-up left out); job MTBF 1800 s / 4
    young = math.sqrt(2 * 3.0 * 450)
    every = auto.history[0][1]
    assert auto.measured["save_s"] == 3.0 and auto.measured["step_s"] == 1.5
    assert abs(every * 1.5 - young) / young < 0.15, (every, young)  # the optimum is near Young's for C << M
    assert 2 < every < 38
    assert steps == [2 + k * every for k in range((40 - 2) // every + 1)] + ([40] if (40 - 2) % every else [])
    assert [s for s, _ in auto.history] == steps
    record = auto.record()
    assert record["every_steps"] == every and record["gpus"] == 4 and record["mode"] == "auto"


def test_auto_interval_first_save_after_a_resume_and_at_a_short_run_end():
    ck = load_config(None, ["checkpoint.save_every=auto"]).checkpoint
    assert AutoSave(ck, 1, last_step=100, start_step=50, agree=list).next_step == 52
    short = AutoSave(ck, 1, last_step=1, start_step=0, agree=list)
    short.record_step(1.0)
    assert short.due(1)
