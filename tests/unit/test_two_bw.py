"""PipeDream-2BW's timeline (pipeline/two_bw.py): its steps, its updates, no flush between steps."""

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.pipeline import two_bw
from threefold.schedules.actions import COMM, Action
from threefold.schedules.registry import build_schedule, validate
from threefold.pipeline.simulate import Costs, simulate


def _grid():
    """Every p up to 16 at m = p, p + 1, 2p + 1, 3p; m = 64 at p = 1 .. 5, 8 and 16 (its steady step
    only repeats past 3p)."""
    for p in range(1, 17):
        largest = {64} if p <= 5 or p in (8, 16) else set()
        for m in sorted(({p, p + 1, 2 * p + 1, 3 * p} | largest) & set(range(p, 65))):
            yield p, m


def test_steps_compose_to_the_unrolled_timeline_which_is_valid_up_to_p16_m64():
    checked = 0
    for p, m in _grid():
        pl = two_bw.plan(p, m)  # runs check_plan: first + steady x (n-1) + drain == unrolled(n), n = 1..4
        s = two_bw.unrolled(p, m, 3)
        two_bw.check_updates(s, m)
        validate(two_bw.without_updates(s), rules=("host", "nccl"))
        assert pl.run(3) == [list(r) for r in s.ranks]
        checked += 1
    assert checked > 60


def test_update_follows_the_batch_last_backward_on_every_rank():
    p, m = 4, 6
    for r, actions in enumerate(two_bw.unrolled(p, m, 3).ranks):
        compute = [a for a in actions if a.kind not in COMM]
        for b in range(3):
            u = compute.index(Action("U", r, b * m + m - 1))
            assert compute[u - 1] == Action("B", r, b * m + m - 1)
            assert all(a.mb // m > b for a in compute[u + 1:] if a.kind == "B")
    # the steady step: every rank's update applies the previous batch's gradient (mb -1: its last)
    pl = two_bw.plan(p, m)
    for r in range(p):
        assert [a for a in pl.steady[r] if a.kind == "U"] == [Action("U", r, -1)]
        assert not any(a.kind == "U" for a in pl.first[r])
        assert [a for a in pl.drain[r] if a.kind == "U"] == [Action("U", r, m - 1)]


def test_an_update_in_the_wrong_place_is_refused():
    p, m = 3, 4
    s = two_bw.unrolled(p, m, 2)
    ranks = [list(r) for r in s.ranks]
    u = ranks[0].index(Action("U", 0, m - 1))
    moved = ranks[0].pop(u)
    first_b = next(i for i, a in enumerate(ranks[0]) if a.kind == "B")
    ranks[0].insert(first_b + 1, moved)  # after the batch's first backward
    bad = two_bw.Schedule(s.name, p, s.microbatches, 1, tuple(tuple(r) for r in ranks))
    with pytest.raises(two_bw.ScheduleError, match="not the batch's last backward"):
        two_bw.check_updates(bad, m)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_no_flush_between_steps(p, m):
    """Rank 0 runs the next batch's first forwards before the previous batch's last backward, inside
    one step; three steps take the time of 1F1B over 3m micro-batches, not three flushed 1F1B steps."""
    pl = two_bw.plan(p, m)
    compute = [a for a in pl.steady[0] if a.kind not in COMM]
    last_b_prev = compute.index(Action("B", 0, -1))
    forwards_before = [a.mb for a in compute[:last_b_prev] if a.kind == "F"]
    assert forwards_before == list(range(p - 1))  # batch t's first p - 1 forwards precede it
    costs = Costs(1.0, 1.0, 1.0)  # F = 1, B = 2
    two = simulate(two_bw.without_updates(two_bw.unrolled(p, m, 3)), costs)
    flushed = simulate(build_schedule("1f1b", p, m), costs)
    assert two.makespan == (3 * m + p - 1) * 3
    assert flushed.makespan == (m + p - 1) * 3
    assert 3 * flushed.makespan - two.makespan == 2 * (p - 1) * 3  # one flush saved per step boundary


def test_build_schedule_shows_two_batches_and_refuses_m_below_p():
    s = build_schedule("pipedream-2bw", 4, 4)
    assert s.microbatches == 8
    validate(s)
    with pytest.raises(ValueError, match="at least as many micro-batches as pipeline ranks"):
        build_schedule("pipedream-2bw", 4, 3)


BASE = ["model.preset=tiny", "model.layers=4", "parallel.pp=2", "pipeline.schedule=pipedream-2bw",
        "train.microbatches=4", "train.grad_clip=0", "model.tie_embeddings=false"]


def test_a_supported_config_validates():
    load_config(None, BASE).validate(2)
    load_config(None, BASE + ["train.grad_clip=1.0"]).validate(2)  # clipped per stage (train/two_bw_step.py)


@pytest.mark.parametrize("override, field", [
    ("train.microbatches=1", "train.microbatches"),
    ("model.tie_embeddings=true", "model.tie_embeddings"), ("precision.compute=fp16", "precision.compute"),
    ("model.experts=4", "model.experts"), ("parallel.zero=1", "parallel.zero"), ("train.compile=true", "train.compile"),
    ("remat.policy=full", "remat.policy"), ("train.eval_every=2", "train.eval_every"),
    ("compress.method=fp16", "compress.method"), ("pipeline.virtual_stages=2", "pipeline.virtual_stages"),
])
def test_unsupported_combinations_are_refused_naming_the_key(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + [override]).validate(2)
    assert e.value.field == field
