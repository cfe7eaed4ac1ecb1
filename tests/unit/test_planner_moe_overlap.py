"""The planner's all-to-all of dualpipev's pairs as threefold's runtime runs them (planner/moe.py): each
side's all-to-all hidden behind the other side's compute, per pair
    exposed = max(0, a2a(F) - compute(B)) + max(0, a2a(B) - compute(F)),
and the layouts whose pairs the runtime overlaps (pipeline/expert_overlap.py)."""

import pytest

from threefold.planner.moe import overlapped_all_to_all, overlapped_pairs, pairs_overlap


def test_each_side_hides_behind_the_other_sides_compute():
    p, m = 4, 8
    for rank in range(p):
        pairs = overlapped_pairs("dualpipev", p, m, rank)
        share = pairs / 2 / m  # two chunks a rank: a pair holds half a micro-batch's F and half a B
        # F's all-to-all (3) longer than B's compute (2): 1 of it stays exposed in every pair;
        # B's (0.5) shorter than F's compute (1): all of it hidden. A summed rule would hide 3 of 3.5.
        f, b, hidden = overlapped_all_to_all("dualpipev", p, m, rank, 1.0, 2.0, 3.0, 0.5)
        assert hidden == pytest.approx(share * (2.0 + 0.5))
        assert f == pytest.approx(3.0 - share * 2.0) and b == pytest.approx(0.5 - share * 0.5)
        # the exposed time of one pair, written out: max(0, 3/2 - 2/2) + max(0, 0.5/2 - 1/2)
        per_pair_exposed = max(0.0, 1.5 - 1.0) + max(0.0, 0.25 - 0.5)
        unpaired = (3.0 + 0.5) * (1 - share)
        assert f + b == pytest.approx(unpaired + pairs * per_pair_exposed / m)


def test_only_layouts_whose_pairs_take_turns_overlap():
    assert pairs_overlap("dualpipev", ep=2, tp=1, zero=1, remat="none", compiled=False)
    assert not pairs_overlap("dualpipev", ep=1, tp=1, zero=1, remat="none", compiled=False)  # no all-to-all
    assert not pairs_overlap("zb-v", ep=2, tp=1, zero=1, remat="none", compiled=False)  # no pairs
    for blocked in (dict(tp=2), dict(zero=3), dict(remat="full"), dict(compiled=True)):
        args = dict(ep=2, tp=1, zero=1, remat="none", compiled=False) | blocked
        assert not pairs_overlap("dualpipev", **args), blocked
