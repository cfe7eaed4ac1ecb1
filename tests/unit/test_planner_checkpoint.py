"""Checkpoint-interval advice (Young/Daly) against a brute-force simulation of failures and saves."""

import pytest

from threefold.planner.checkpoint_interval import advise, daly, lost_fraction, simulate, young

# (save seconds, MTBF hours per GPU, GPUs, restart seconds): job MTBFs of 7.5 min to 2 h, so that a
# simulation of 100k segments sees tens of thousands of failures (statistical error well under 1%)
CASES = [(20, 2.0, 8, 0.0), (60, 16.0, 16, 120.0), (5, 1.0, 8, 30.0)]


@pytest.mark.parametrize("save_s,mtbf_h,gpus,restart_s", CASES)
def test_expected_lost_time_matches_a_simulation_within_2_percent(save_s, mtbf_h, gpus, restart_s):
    a = advise(save_s, mtbf_h, gpus, restart_s)
    simulated = simulate(a.interval_s, save_s, mtbf_h, gpus, restart_s, segments=100_000, seed=1)
    assert abs(simulated / a.lost_fraction - 1) <= 0.02, f"simulated {simulated:.4f} vs {a.lost_fraction:.4f}"
    # the advised interval is the best: halving or doubling it loses more time in the simulation too
    for factor in (0.5, 2.0):
        worse = simulate(a.interval_s * factor, save_s, mtbf_h, gpus, restart_s, segments=100_000, seed=2)
        assert worse > simulated


def test_young_and_daly_closed_forms():
    C, M = 60.0, 3600.0 * 4
    assert young(C, M) == pytest.approx((2 * C * M) ** 0.5)
    x = C / (2 * M)
    assert daly(C, M) == pytest.approx((2 * C * M) ** 0.5 * (1 + x ** 0.5 / 3 + x / 9) - C)
    assert daly(3 * M, M) == M
    # the numerical optimum sits next to Daly's higher-order form, and both beat Young's slightly
    a = advise(C, 4 * 1024, 1024)
    assert a.interval_s == pytest.approx(a.daly_s, rel=0.01)
    assert lost_fraction(a.interval_s, C, M) <= lost_fraction(a.young_s, C, M)


def test_advice_in_steps_and_its_parts():
    a = advise(30.0, 50_000, 4096, restart_s=300.0, step_s=7.0)
    assert a.every_steps == round(a.interval_s / 7.0) and a.interval_s == a.every_steps * 7.0
    assert a.lost_fraction == pytest.approx(a.save_fraction + a.failure_fraction)
    assert 0 < a.save_fraction < a.lost_fraction < 0.1
    assert "checkpoint every" in a.describe() and "expected" in a.describe()
