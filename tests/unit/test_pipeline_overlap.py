"""The overlap figure of dualpipev's pairs (pipeline/overlap.py): each exchange's posted, wait and end times."""

import pytest

from threefold.pipeline.overlap import Tally


def test_hidden_is_the_time_between_posting_and_waiting():
    """An exchange posted at 1, waited for at 4, done at 5: 4 s in flight, 3 of them hidden (the rank
    computed the other side meanwhile); one waited where it is posted hides nothing; one done before its
    wait hides all of its time in flight."""
    tally = Tally()
    tally.add(switched=True, posted=1.0, wait=4.0, end=5.0)
    assert (tally.in_flight_s, tally.hidden_s) == (4.0, 3.0)
    tally.add(switched=False, posted=10.0, wait=10.0, end=12.0)
    assert (tally.exchanges, tally.switched, tally.in_flight_s, tally.hidden_s) == (2, 1, 6.0, 3.0)
    tally.add(switched=True, posted=20.0, wait=25.0, end=22.0)
    assert tally.to_dict() == {"exchanges": 3, "switched": 2, "in_flight_s": 8.0, "hidden_s": 5.0,
                               "fraction": pytest.approx(5 / 8)}
    assert Tally().fraction == 0.0


def test_busy_time_counts_a_pair_running_at_once_once():
    from threefold.pipeline.timeline import Event, bubble_fractions, busy_time

    events = [Event(0, "F", 0, 3, 0, 2), Event(0, "B", 3, 1, 1, 3), Event(0, "W", 0, 0, 5, 6),
              Event(1, "F", 1, 0, 0, 6)]
    assert busy_time(events, 0) == 4  # 0-3 and 5-6, not 2 + 2 + 1
    assert bubble_fractions(events, 2) == [pytest.approx(1 / 3), 0.0]


def test_a_switch_passes_the_turn_only_between_two_live_sides():
    """Two sides of a pair alternate at every switch (each returns True once the turn comes back); once
    one side has ended the other's switches return False at once, as do those of a thread that is no side."""
    import threading

    from threefold.pipeline.expert_overlap import Turns

    turns, order, results = Turns(), [], {"a": [], "b": []}

    def run(name: str, steps: int) -> None:
        with turns.side(name):
            for i in range(steps):
                order.append(f"{name}{i}")
                results[name].append(turns.switch())

    turns.begin(["a", "b"])
    threads = [threading.Thread(target=run, args=(name, n)) for name, n in (("a", 4), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]  # b's last switch came back when a2 switched
    assert results == {"a": [True, True, True, False], "b": [True, True]}
    assert turns.switch() is False and not turns.paired()
