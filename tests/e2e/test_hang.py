"""A rank that skips a collective: the watchdog stops the world and the report names it."""

import json
import os
from pathlib import Path

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


def test_rank_skipping_a_collective_is_named_and_no_process_is_left(tmp_path):
    timeout_s = 5
    run = threefold("train", "--nproc", "4", "--model", "tiny", "--steps", "4", "--global-batch", "8",
                    "--seq-len", "16", "--no-progress", "--out", str(tmp_path),
                    "--set", f"debug.hang_timeout_s={timeout_s}", "--set", "debug.hang_grace_s=5",
                    "--set", "fault.kind=skip_collective", "--set", "fault.rank=2", "--set", "fault.step=2",
                    timeout=180)
    assert run.returncode == 1, run.stderr
    report = json.loads((tmp_path / "flight" / "hang-report.json").read_text())
    assert report["never_joined"] == [2] and report["missing"] == []
    (wait,) = report["waits"]
    assert wait["waiting"] == [0, 1, 3]
    assert wait["op"] == "all_reduce.metrics" and wait["axis"] == "dp" and wait["callsite"].startswith("trainer.py:")
    assert wait["in_flight_s"] >= timeout_s
    assert "in stall" in report["ranks"]["2"]["where"]  # where the rank that never joined is
    # the launcher printed the report after the failure
    assert "never joined: rank 2" in run.stderr and "ranks 0,1,3 wait in all_reduce.metrics on dp" in run.stderr
    assert sorted(p.name for p in (tmp_path / "flight").glob("rank-*.json")) == [f"rank-{r}.json" for r in range(4)]
    assert _processes_mentioning(str(tmp_path)) == []  # every worker ended
