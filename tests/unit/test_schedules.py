"""Schedules as data: textbook bubbles in the simulator, activation peaks, and the validator."""

import functools
from fractions import Fraction

import pytest

from threefold.schedules.registry import (SCHEDULES, Action, Schedule, ScheduleError, build_schedule, check,
                                          compute_orders, paired_schedule, validate)
from threefold.pipeline.simulate import Costs, simulate


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gpipe_and_1f1b_bubble_is_textbook(name, p, m):
    sim = simulate(build_schedule(name, p, m))  # equal unit costs F = I = W = 1
    expected = Fraction(p - 1, m + p - 1)
    for rank, bubble in enumerate(sim.bubble):
        assert bubble == pytest.approx(float(expected), abs=1e-12), f"rank {rank}"
    assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (4, 12, 3), (8, 16, 2),
                                     (4, 6, 2), (4, 9, 3), (3, 7, 2)])
def test_interleaved_bubble_is_reduced_by_v(p, m, v):
    # each chunk holds 1/v of a rank's layers, so it costs 1/v: the bubble time shrinks v-fold
    sim = simulate(build_schedule("interleaved", p, m, v), Costs(1 / v, 1 / v, 1 / v))
    assert max(sim.bubble) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    one_f_one_b = simulate(build_schedule("1f1b", p, m))
    assert one_f_one_b.bubble_time[0] / sim.bubble_time[0] == pytest.approx(v)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 32), (8, 8), (8, 24), (16, 64)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    zb = simulate(build_schedule("zb-h1", p, m))
    ref = simulate(build_schedule("1f1b", p, m))
    # bubble time (p-1)(F+I-W) against (p-1)(F+I+W): exactly a third with F = I = W
    for r in range(p):
        assert zb.bubble_time[r] == pytest.approx(p - 1)
        assert ref.bubble_time[r] == pytest.approx(3 * (p - 1))
    assert max(zb.bubble) < max(ref.bubble) / 2
    assert max(zb.peak_activations) <= p  # same activation budget as 1F1B (held until W)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 2), (4, 8), (8, 16)])
def test_peak_activations(p, m):
    gpipe = simulate(build_schedule("gpipe", p, m)).peak_activations
    assert gpipe == [m] * p
    one_f_one_b = simulate(build_schedule("1f1b", p, m)).peak_activations
    assert max(one_f_one_b) <= p
    assert one_f_one_b == [min(p - r, m) for r in range(p)]


def test_communication_latency_lengthens_the_makespan():
    fast = simulate(build_schedule("1f1b", 4, 8))
    slow = simulate(build_schedule("1f1b", 4, 8), Costs(comm=0.5))
    assert slow.makespan > fast.makespan


# ---------------------------------------------------------------- validator


def _grid(ps=range(1, 17), ms=lambda p: {1, 2, p - 1, p, p + 1, 2 * p + 1, 3 * p, 64}):
    """Every p up to 16 with micro-batch counts around the interesting points up to 64 (the full
    sweep, `python -m tests.unit.test_schedules`); `ps` and `ms` bound it."""
    for p in ps:
        for m in sorted(set(ms(p)) & set(range(1, 65))):
            for name in SCHEDULES:
                if name == "pipedream-2bw":  # needs m >= p (unit/test_two_bw.py checks its steps)
                    if m >= p:
                        yield name, p, m, 1
                elif name == "interleaved":
                    if m >= p:
                        for v in (1, 2, 3, 4) if m == p else (2,):
                            yield name, p, m, v
                elif check(name, p, m) is None:
                    yield name, p, m, 1


def _validate_all(grid) -> tuple[int, set]:
    """Validate every entry (host and NCCL rules), dualpipev also as the runtime runs its pairs
    (`paired_schedule`); (count, the schedules covered)."""
    checked, names = 0, set()
    for name, p, m, v in grid:
        s = build_schedule(name, p, m, v)
        validate(s)
        if SCHEDULES[name].pairs is not None:
            paired, together = paired_schedule(s)
            validate(paired)
            assert [len(t) for t in together] == [len(SCHEDULES[name].pairs(p, m, r)) for r in range(p)]
        checked, names = checked + 1, names | {name}
    return checked, names


# the bounded sweep of the suite: p at the small and odd sizes and 8, 16; m at the edges of each
# schedule's checks (p - 1, p, p + 1, 2p, 2p + 1) below 8, 2p + 1 at 8 and the largest, p = 16 with m = 64
BOUNDED = dict(ps=(1, 2, 3, 4, 5, 8, 16),
               ms=lambda p: {1, p - 1, p, p + 1, 2 * p, 2 * p + 1} if p < 8 else {2 * p + 1} if p < 16 else {64})


def test_every_schedule_is_valid_at_representative_sizes_up_to_p16_m64():
    checked, names = _validate_all(_grid(**BOUNDED))
    assert names == set(SCHEDULES)  # every registered schedule, the largest p and m among them
    assert {(n, 16, 64) for n in SCHEDULES} <= {(n, p, m) for n, p, m, _ in _grid(**BOUNDED)}
    assert checked > 100


def full_sweep() -> int:
    """Every p <= 16 with m around the interesting points up to 64 (about a minute)."""
    checked, _ = _validate_all(_grid())
    return checked




def _replace(s: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(actions)
    return Schedule(s.name, s.pp, s.microbatches, s.virtual, tuple(ranks), s.placement)


def test_validator_rejects_a_missing_backward():
    s = build_schedule("1f1b", 4, 8)
    broken = _replace(s, 2, [a for a in s.ranks[2] if a != Action("B", 2, 5)])
    with pytest.raises(ScheduleError, match="never completes the backward of micro-batch 5 on stage 2"):
        validate(broken)


def test_validator_rejects_a_deadlock():
    # GPipe, but rank 0 wants the gradient of micro-batch 0 before it sends micro-batch 3 forward,
    # while rank 1 runs every forward before its first backward: a cycle across the two ranks
    s = build_schedule("gpipe", 2, 4)
    actions = list(s.ranks[0])
    f3 = actions.index(Action("F", 0, 3))
    for moved in (Action("B", 0, 0), Action("RECV_B", 0, 0)):
        actions.insert(f3, actions.pop(actions.index(moved)))
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at B0@s0; rank 1 waits at F3@s1"):
        validate(_replace(s, 0, actions))


def test_validator_rejects_receives_out_of_fifo_order():
    s = build_schedule("gpipe", 2, 4)
    actions = list(s.ranks[1])
    # both receives posted before their consumers, but the second message's first
    late = actions.pop(actions.index(Action("RECV_F", 1, 1)))
    actions.insert(actions.index(Action("RECV_F", 1, 0)), late)
    with pytest.raises(ScheduleError, match="FIFO"):
        validate(_replace(s, 1, actions))


def test_validator_rejects_a_missing_send_and_a_wrong_rank_and_a_duplicate():
    s = build_schedule("zb-h1", 4, 4)
    no_send = _replace(s, 1, [a for a in s.ranks[1] if a != Action("SEND_F", 1, 3)])
    with pytest.raises(ScheduleError, match="lacks SEND_F3@s1"):
        validate(no_send)
    stray = _replace(s, 0, list(s.ranks[0]) + [Action("W", 1, 0)])
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        validate(stray)
    twice = _replace(s, 3, list(s.ranks[3]) + [Action("W", 3, 0)])
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(twice)
    w_first = list(s.ranks[3])
    i, w = w_first.index(Action("I", 3, 0)), w_first.index(Action("W", 3, 0))
    w_first[i], w_first[w] = w_first[w], w_first[i]
    with pytest.raises(ScheduleError, match="runs W0@s3 before I0@s3"):
        validate(_replace(s, 3, w_first))


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        compute_orders("pipedream", 2, 4)
    with pytest.raises(ValueError, match=r"at least as many micro-batches as pipeline ranks \(2 < 4\)"):
        compute_orders("interleaved", 4, 2, 2)
    with pytest.raises(ValueError, match="virtual stages need 'interleaved'"):
        compute_orders("1f1b", 4, 8, 2)


# ---------------------------------------------------------------- the V schedules (zb-v, dualpipev)


V_SCHEDULES = ("zb-v", "dualpipev")


def test_every_schedule_is_one_registration():
    from threefold.config.sections import SCHEDULE_NAMES

    assert SCHEDULE_NAMES == tuple(SCHEDULES) and {"zb-v", "dualpipev"} <= set(SCHEDULES)
    for name, kind in SCHEDULES.items():
        assert kind.name == name and kind.placement in ("interleaved", "v") and kind.summary
    assert [SCHEDULES[n].chunks_for(1) for n in V_SCHEDULES] == [2, 2]


def v_sizes(p: int) -> list[int]:
    """Every m from 1 through 4p + 1 (the warm-up, its edges and two steady cycles past them) and the
    largest, 63 and 64: past 4p the order only repeats its steady cycle (every m up to 64:
    `python -m tests.unit.test_schedules v`)."""
    return sorted((set(range(1, 4 * p + 2)) | {63, 64}) & set(range(1, 65)))


def _validate_v(name: str, sizes) -> int:
    checked = 0
    for p in range(1, 9):
        for m in sizes(p):
            if check(name, p, m) is None:
                validate(build_schedule(name, p, m))
                checked += 1
    return checked


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_schedules_are_valid_for_every_p_up_to_8_at_every_m_up_to_4p_and_at_64(name):
    """Every (p, m) of `v_sizes` the schedule accepts, under host and NCCL rules (p up to 16: the grid above)."""
    assert _validate_v(name, v_sizes) == (168 if name == "zb-v" else 104)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_placement_puts_the_second_chunk_back_up_the_pipeline(name):
    s = build_schedule(name, 4, 8)
    assert s.virtual == 2 and [s.stage_rank(st) for st in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for r, actions in enumerate(s.ranks):
        assert {a.stage for a in actions} == {r, 7 - r}
    # stages 3 -> 4 meet on rank 3: a local hand-off, no transfer
    assert not any(a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") and a.stage in (3, 4) and
                   (a.kind in ("SEND_F", "RECV_B")) == (a.stage == 3) for a in s.ranks[3])
    # the loss (last stage) is computed on rank 0, as the first stage
    assert any(a == Action("F", 7, 0) for a in s.ranks[0])


@functools.cache
def _flat_bubble(name: str, p: int, m: int) -> float:
    """The largest per-rank bubble of a one-chunk schedule (both V schedules compare with the same ones)."""
    return max(simulate(build_schedule(name, p, m)).bubble)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_bubble_is_the_registered_term_and_below_zb_h1_and_1f1b(name):
    for p in range(2, 17):
        for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 3 * p, 64} & set(range(1, 65))):
            if check(name, p, m):
                continue
            sim = simulate(build_schedule(name, p, m), Costs(0.5, 0.5, 0.5))  # two chunks: half a rank each
            assert max(sim.bubble) == pytest.approx(SCHEDULES[name].bubble(p, m, 2), abs=1e-12), (p, m)
            if m >= 2 * p:
                assert max(sim.bubble) < _flat_bubble("zb-h1", p, m), (p, m)
                assert max(sim.bubble) < _flat_bubble("1f1b", p, m), (p, m)


def test_dualpipev_pairs_are_adjacent_forward_then_backward():
    for p, m in ((2, 4), (4, 8), (4, 13), (8, 16)):
        for r in range(p):
            order = compute_orders("dualpipev", p, m)[r]
            pairs = SCHEDULES["dualpipev"].pairs(p, m, r)
            assert len(pairs) == 2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - 1 - r)
            for f, b in pairs:
                i = order.index(f)
                assert f.kind == "F" and b.kind == "B" and order[i + 1] == b and f.stage != b.stage


def test_v_schedules_refuse_with_the_fix():
    with pytest.raises(ValueError, match=r"dualpipev needs at least as many micro-batches as stages, 2 x pp "
                                         r"\(6 < 8\); raise microbatches to 8 or more"):
        compute_orders("dualpipev", 4, 6)
    with pytest.raises(ValueError, match="runs 2 chunks per rank; leave virtual stages at 1"):
        compute_orders("zb-v", 4, 8, 3)


def test_validator_rejects_w_before_i_and_a_misplaced_second_chunk_in_zb_v():
    s = build_schedule("zb-v", 2, 4)
    actions = list(s.ranks[0])
    i, w = actions.index(Action("I", 3, 0)), actions.index(Action("W", 3, 0))
    actions[i], actions[w] = actions[w], actions[i]
    with pytest.raises(ScheduleError, match="runs W0@s3 before I0@s3"):
        validate(_replace(s, 0, actions))
    # the interleaved placement (stage 3 on rank 1) for the V's lists
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        validate(Schedule(s.name, s.pp, s.microbatches, s.virtual, s.ranks, "interleaved"))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["v"]:
        for v_name in V_SCHEDULES:
            print(f"{v_name}: {_validate_v(v_name, lambda p: range(1, 65))} (p, m) valid (every p <= 8, m <= 64)")
    else:
        print(f"{full_sweep()} schedules valid under host and NCCL rules (p <= 16, m <= 64)")
