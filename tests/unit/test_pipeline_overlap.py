"""The overlap figure of dualpipev's pairs (pipeline/overlap.py): interval arithmetic on known spans."""

import pytest

from threefold.pipeline.overlap import PairTimes, Tally, intersect, length, minus, union


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert length([(0, 2), (1, 3)]) == 3
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert minus((0, 10), [(2, 3), (2.5, 4), (9, 12)]) == [(0, 2), (4, 9)]


def test_hidden_is_the_other_side_computing_while_an_all_to_all_is_in_flight():
    # F computes 0-2, waits on its all-to-all 2-5, computes 5-6; B computes 1-4 then waits 4-7
    pair = PairTimes(forward=(0, 6), backward=(1, 7), forward_comm=[(2, 5)], backward_comm=[(4, 7)])
    assert pair.in_flight() == 6
    # F's 2-5 against B computing 1-4: 2; B's 4-7 against F computing 0-2, 5-6: 1
    assert pair.hidden() == 3
    back_to_back = PairTimes(forward=(0, 6), backward=(6, 13), forward_comm=[(2, 5)], backward_comm=[(10, 13)])
    assert back_to_back.hidden() == 0
    tally = Tally()
    tally.add(pair)
    tally.add(back_to_back)
    assert tally.to_dict() == {"pairs": 2, "in_flight_s": 12, "hidden_s": 3, "fraction": pytest.approx(0.25)}


def test_busy_time_counts_a_pair_running_at_once_once():
    from threefold.pipeline.timeline import Event, bubble_fractions, busy_time

    events = [Event(0, "F", 0, 3, 0, 2), Event(0, "B", 3, 1, 1, 3), Event(0, "W", 0, 0, 5, 6),
              Event(1, "F", 1, 0, 0, 6)]
    assert busy_time(events, 0) == 4  # 0-3 and 5-6, not 2 + 2 + 1
    assert bubble_fractions(events, 2) == [pytest.approx(1 / 3), 0.0]
