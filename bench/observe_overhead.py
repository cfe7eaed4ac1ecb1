"""Cost of the debugging tools: the same training steps with them off and on, side by side.

Every rank builds one Trainer per variant (same model, data and world) and the timed steps
alternate between them one by one, so machine noise hits all alike:

    off        no flight record (debug.history=0), no watchdog, no statistics
    on         flight record + hang watchdog + per-rank statistics (one all-gather per step):
               the defaults of a production run with debug.stats=true; target: <= 3% of step time
    debugging  on + NaN hooks on every module + replica hash and collective fingerprint every
               10 steps + trace (a debugging session's settings; informative, no target)

Prints the median step time of each variant over `--steps` steps and its overhead against `off`:
the median over the steps of the ratio to the `off` step run next to it (adjacent steps see the
same machine load; the median keeps a step that a busy machine slowed from deciding it).
On a shared machine that end-to-end figure carries a few percent of noise either way, so the
bench also *accounts* the cost of `on` directly: the time spent inside the observer's step hooks
(statistics all-gather included) plus the flight record's cost per collective (measured over
many calls of the recording path against the non-recording one) times the collectives per step,
over the `off` step time.

    python bench/observe_overhead.py [--nproc 2] [--model small] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from threefold.config import load_config
from threefold.launch.world import World

VARIANTS = {
    "off": ["debug.history=0", "debug.watchdog=false"],
    "on": ["debug.stats=true"],
    "debugging": ["debug.stats=true", "debug.nan_check=true", "debug.replica_check_every=10",
                  "debug.fingerprint_every=10", "debug.trace=true"],
}


def bench_rank(args: dict, out: str) -> dict:
    from threefold.train.trainer import Trainer

    n = torch.distributed.get_world_size()
    common = [f"model.preset={args['model']}", f"train.seq_len={args['seq_len']}",
              f"train.global_batch={args['batch_per_rank'] * n}", "train.steps=1000000", "run.progress=false",
              "run.plot=false"]
    trainers = {}
    for name, extra in VARIANTS.items():
        trainers[name] = Trainer(load_config(None, [*common, *extra, f"run.out={out}/{name}"]))
        trainers[name].observer.start()
    hooks_s = _time_hooks(trainers["on"].observer)
    for _ in range(2):  # warm-up
        for trainer in trainers.values():
            trainer.train_one_step()
    hooks_s.clear()
    times = {name: [] for name in trainers}
    order = list(trainers.items())
    for i in range(args["steps"]):
        for name, trainer in (order if i % 2 == 0 else order[::-1]):  # no variant always goes first
            torch.distributed.barrier()
            start = time.perf_counter()
            trainer.train_one_step()  # ends with the loss all-reduce: every rank is done
            times[name].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.observer.stop()
    calls_per_step = trainers["on"].comm._seq / (args["steps"] + 2)
    return {"times": times, "hooks_s": sum(hooks_s) / args["steps"], "calls_per_step": calls_per_step,
            "record_s": _record_cost(trainers["on"].comm)}


def _time_hooks(observer) -> list[float]:
    """Wrap the observer's per-step hooks with a clock."""
    spent = []
    for name in ("step_begin", "step_end"):
        original = getattr(observer, name)

        def timed(*a, _original=original, **k):
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                spent.append(time.perf_counter() - start)
        setattr(observer, name, timed)
    return spent


def _record_cost(comm, calls: int = 20000) -> float:
    """Seconds per collective that the flight record adds (record, call site, group, listeners)."""
    x = torch.zeros(4)
    timings = {}
    for recording in (False, True, False, True):
        comm.recording = recording
        start = time.perf_counter()
        for _ in range(calls):
            comm._start("all_reduce", "dp", x, 16)
        timings.setdefault(recording, []).append((time.perf_counter() - start) / calls)
    comm.recording = True
    return max(0.0, min(timings[True]) - min(timings[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    args = vars(parser.parse_args())
    load_config(None, [f"model.preset={args['model']}"])  # a mistake fails here, before any process starts
    with tempfile.TemporaryDirectory() as out, World(args["nproc"], threads=max(1, torch.get_num_threads() // args["nproc"])) as world:
        result = world.run(bench_rank, args, out)[0]
    times = result["times"]
    print(f"model={args['model']} seq_len={args['seq_len']} batch/rank={args['batch_per_rank']} "
          f"processes={args['nproc']} gloo CPU; {args['steps']} alternating steps per variant")
    print(f"{'variant':>10} {'step s (median)':>16} {'overhead vs off':>16}")
    off = statistics.median(times["off"])
    for name, steps in times.items():
        ratio = statistics.median(t / o for t, o in zip(steps, times["off"]))
        print(f"{name:>10} {statistics.median(steps):>16.4f} {100 * (ratio - 1):>15.2f}%")
    accounted = result["hooks_s"] + result["calls_per_step"] * result["record_s"]
    print(f"accounted cost of 'on' per step: {1e3 * result['hooks_s']:.2f} ms in the observer's step hooks + "
          f"{result['calls_per_step']:.1f} collectives x {1e6 * result['record_s']:.1f} us of flight record = "
          f"{100 * accounted / off:.2f}% of the 'off' step (target <= 3%)")


if __name__ == "__main__":
    main()
