"""A rank that skips a collective: the watchdog stops the world and the report names it. The world is
(dp 2, cp 2), so the collective is the loss sum over the batch and sequence axes together (`dp+cp`)
and every rank is placed by its dp and cp coordinates."""

import json
import os
import time
from pathlib import Path

import pytest

from tests.e2e.cli import threefold


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


ARGS = ("--nproc", "4", "--cp", "2", "--model", "tiny", "--global-batch", "8", "--seq-len", "16", "--no-progress")


@pytest.mark.timeout(2400)  # its own limits scale with the machine's observed speed
def test_rank_skipping_a_collective_is_named_and_no_process_is_left(tmp_path):
    # Timing from this machine's observed speed, not fixed: a healthy run of the same job first
    # (start-up and step time), then the watchdog's limit well above any healthy step's wait and
    # the whole run's limit well above start-up + steps + limit + report.
    healthy_out = tmp_path / "healthy"
    started = time.monotonic()
    healthy = threefold("train", *ARGS, "--steps", "2", "--out", str(healthy_out), timeout=1800)
    wall_s = time.monotonic() - started
    assert healthy.returncode == 0, healthy.stderr
    steps = [json.loads(line) for line in (healthy_out / "metrics.jsonl").read_text().splitlines()]
    timeout_s = max(5.0, round(10 * max(s["step_time_s"] for s in steps), 1))
    grace_s = max(5.0, timeout_s)
    out = tmp_path / "hang"
    run = threefold("train", *ARGS, "--steps", "4", "--out", str(out),
                    "--set", f"debug.hang_timeout_s={timeout_s}", "--set", f"debug.hang_grace_s={grace_s}",
                    "--set", "fault.kind=skip_collective", "--set", "fault.rank=2", "--set", "fault.step=2",
                    timeout=3 * wall_s + timeout_s + 4 * grace_s + 120)
    tmp_path = out
    assert run.returncode == 1, run.stderr
    report = json.loads((tmp_path / "flight" / "hang-report.json").read_text())
    assert report["never_joined"] == [2] and report["missing"] == []
    (wait,) = report["waits"]
    assert wait["waiting"] == [0, 1, 3]
    assert wait["op"] == "all_reduce.metrics" and wait["axis"] == "dp+cp" and wait["group"] == [0, 1, 2, 3] and wait["callsite"].startswith("step.py:")  # the step's metrics reduce
    assert wait["in_flight_s"] >= timeout_s
    assert "in stall" in report["ranks"]["2"]["where"]  # where the rank that never joined is
    assert report["ranks"]["2"]["coords"] == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    # the launcher printed the report after the failure
    assert "never joined: rank 2" in run.stderr and "ranks 0,1,3 wait in all_reduce.metrics on dp+cp" in run.stderr
    assert "rank 2 (pp=0 dp=1 cp=0 tp=0)" in run.stderr
    assert sorted(p.name for p in (tmp_path / "flight").glob("rank-*.json")) == [f"rank-{r}.json" for r in range(4)]
    assert _processes_mentioning(str(tmp_path)) == []  # every worker ended
