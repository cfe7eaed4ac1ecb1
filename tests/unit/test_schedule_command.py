"""`threefold schedule`: pictures, traces and one-line errors."""

import json

import pytest

from threefold.cli import main
from threefold.pipeline.draw import draw_timeline
from threefold.schedules.registry import build_schedule
from threefold.pipeline.simulate import simulate


@pytest.mark.parametrize("schedule, extra, suffix", [("gpipe", [], "png"), ("1f1b", [], "svg"),
                                                     ("interleaved", ["--virtual-stages", "2"], "png"),
                                                     ("zb-h1", [], "png")])
def test_schedule_command_draws_and_traces(tmp_path, capsys, schedule, extra, suffix):
    out, trace = tmp_path / f"s.{suffix}", tmp_path / "s.json"
    rc = main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", schedule, *extra,
               "--out", str(out), "--trace", str(trace)])
    assert rc == 0
    assert out.stat().st_size > 1000
    events = json.loads(trace.read_text())["traceEvents"]
    compute = [e for e in events if e.get("ph") == "X"]
    per_microbatch = 3 if schedule == "zb-h1" else 2
    v = 2 if schedule == "interleaved" else 1
    assert len(compute) == 4 * 8 * v * per_microbatch
    assert {e["tid"] for e in compute} == {0, 1, 2, 3}
    printed = capsys.readouterr().out
    assert "bubble" in printed and "peak activations" in printed


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "2"], "2 < 4"),
    (["--schedule", "1f1b", "--microbatches", "8", "--out", "x.pdf"], "must end in .png or .svg"),
    (["--schedule", "1f1b", "--microbatches", "8", "--virtual-stages", "2"], "virtual stages need"),
])
def test_schedule_command_bad_input(tmp_path, capsys, argv, message):
    base = ["schedule", "--pp", "4", "--out", str(tmp_path / "x.png")]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_unknown_schedule_exits_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "pipedream", "--out", str(tmp_path / "x.png")])
    assert e.value.code == 2


def test_draw_a_measured_style_timeline(tmp_path):
    sim = simulate(build_schedule("1f1b", 2, 4))
    shifted = [e._replace(start=e.start * 0.01 + 100.0, end=e.end * 0.01 + 100.0) for e in sim.events]
    assert draw_timeline(shifted, 2, tmp_path / "t.png", "measured", unit="seconds").stat().st_size > 1000
