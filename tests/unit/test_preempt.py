"""train/preempt.py in one process: the signals reach the stop request on their own thread; a
second SIGINT ends the process at once; the handlers before come back."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import threefold
from threefold.train.preempt import INTERRUPTED_EXIT, StopSignals

SRC = str(Path(threefold.__file__).parents[1])


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=SRC))


def test_stop_signals_are_noted_once_and_the_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    stop = StopSignals()
    with stop.watching():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a later one changes nothing: the first is the reason
        while stop.received < 2:
            pass
    assert stop.first == signal.SIGUSR1
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup descriptor left behind


def test_a_second_sigint_stops_at_once_while_the_main_thread_waits_in_cpp():
    """The second SIGINT comes while the main thread waits inside torch's C++ (as in a collective
    waiting for a peer), where Python would run no handler of its own until the wait ends: it ends
    the process at once with 130 and one line. A helper thread sends it once the main thread sleeps
    on the line of the wait."""
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        from datetime import timedelta
        from torch.distributed import TCPStore
        from threefold.train.preempt import StopSignals

        def second_sigint(main, line):
            while True:
                frame = sys._current_frames().get(main.ident)
                stat = open(f"/proc/self/task/{main.native_id}/stat").read()
                if frame is not None and frame.f_lineno == line and stat.rsplit(")", 1)[1].split()[0] == "S":
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.01)

        store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=600))
        stop = StopSignals()
        with stop.watching():
            os.kill(os.getpid(), signal.SIGINT)
            while stop.first is None:
                pass
            print("noted", stop.first.name, flush=True)
            threading.Thread(target=second_sigint, args=(threading.main_thread(), WAIT_LINE), daemon=True).start()
            store.wait(["never set"])  # 600 s
        print("not stopped", flush=True)
    """)
    wait_line = next(n for n, line in enumerate(code.splitlines(), 1) if "store.wait(" in line)
    child = run_child(code.replace("WAIT_LINE", str(wait_line)))
    assert child.returncode == INTERRUPTED_EXIT, child.stderr
    assert child.stdout == "noted SIGINT\n"
    assert child.stderr == "threefold: SIGINT again: stopped at once, without saving; exit 130\n"


def test_sigterm_twice_is_one_stop():
    child = run_child("""
        import os, signal
        from threefold.train.preempt import StopSignals
        stop = StopSignals()
        with stop.watching():
            for n in (1, 2):  # the second once the first is taken (the kernel merges a pending one)
                os.kill(os.getpid(), signal.SIGTERM)
                while stop.received < n:
                    pass
        print(stop.first.name)
    """)
    assert child.returncode == 0 and child.stdout == "SIGTERM\n", child.stderr
