"""`data prepare`: an empty file holds no document (skipped and counted, never refusing the run), and a
SIGKILLed `data prepare` leaves no worker process behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data_helpers import prepare
from threefold.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize("skip", [False, True])
def test_an_empty_file_is_skipped_and_counted(tmp_path, capsys, skip):
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt").write_text("some text " * 50)
    (files / "b.txt").write_text("")
    (files / "c.jsonl").write_text("")
    extra = ("--val-fraction", "0", "--workers", "1") + (("--skip-bad-documents",) if skip else ())
    assert prepare(tmp_path / "out", str(files), extra=extra) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["empty_files"] == 2 and index["skipped_documents"] == 0
    assert index["splits"]["train"]["documents"] == 1
    assert "empty files skipped 2" in capsys.readouterr().err


def test_only_empty_files_is_refused_for_having_no_tokens(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert prepare(tmp_path / "out", str(tmp_path / "empty.txt"), extra=("--workers", "1")) == 2
    assert "gave no training tokens" in capsys.readouterr().err


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_killed_prepare_leaves_no_worker_running(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt").write_text("some text " * 50)
    # a named pipe nobody writes: the worker that takes it blocks in open() for ever, so the run is
    # deterministically mid-way when the driver is killed
    os.mkfifo(files / "z.jsonl")
    env = dict(os.environ, PYTHONPATH=SRC)
    child = subprocess.Popen([sys.executable, "-m", "threefold", "data", "prepare", str(files / "a.txt"),
                              str(files / "z.jsonl"), "--out", str(tmp_path / "out"), "--workers", "2",
                              "--no-progress"], env=env, stderr=subprocess.DEVNULL)
    workers = []
    try:
        parts = tmp_path / ".out.preparing" / "parts"  # where it writes until complete
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            workers = _children(child.pid)
            if len(workers) == 2 and parts.is_dir() and list(parts.glob("*.json")):
                break
            time.sleep(0.05)
        assert child.poll() is None and len(workers) == 2, workers
        time.sleep(0.5)  # both workers past their initializer (the one with the pipe is blocked in open())
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, workers)):
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "workers outlived their killed parent"
    finally:
        child.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
