"""dualpipev's expert exchanges: how much of their time the pairs hide, overlapped against serial.

One training run of `tiny-moe` on 4 gloo processes (pp = 2, ep = 2 over dp = 2, dualpipev) whose
steps alternate between the pairs run one side after the other (serial: each pair's F then its B,
every exchange waited where it is posted), overlapped (the two sides taking turns at every exchange,
pipeline/expert_overlap.py), and serial with the sparse blocks' own blocking `all_to_all` dispatch
(parallel/expert.py, "serial-a2a": the runtime before the overlap), the order reversed every round.
Every exchange of the paired dispatch logs when it was posted, when its caller began to wait and
when it completed; hidden = min(wait, end) - posted (pipeline/overlap.py; the all_to_all dispatch
blocks from issue to completion: nothing hidden, not logged). Per step it prints, summed over
the 4 ranks, the hidden share of the paired exchanges' time and of every ep exchange of the step, the
exposed exchange time per rank and the step time (the slowest rank); quartiles over the rounds, and
the load average before and after.

    PYTHONPATH=src:. python bench/dualpipe_overlap.py --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from threefold.launch.world import World

MODES = ("serial", "overlapped", "serial-a2a")  # the last: the blocking all_to_all dispatch of parallel/expert.py


def _overrides(args) -> list[str]:
    return ["model.preset=tiny-moe", f"model.layers={args.layers}", f"model.hidden={args.hidden}",
            f"train.global_batch={args.batch}", f"train.seq_len={args.seq}", f"train.steps={2 * args.rounds + 2}",
            "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "pipeline.schedule=dualpipev",
            f"train.microbatches={args.microbatches}", "run.progress=false", "run.plot=false"]


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("in_flight_s", "hidden_s")}


def run_rounds(overrides: list[str], out: str, rounds: int) -> list[dict]:
    """On every rank: one warm-up step of each mode, then `rounds` rounds of one step of each, the
    order swapped every round; per step the mode, its wall time and its exchange figures."""
    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, [f"run.out={out}", *overrides]))
    runtime = trainer.parallel.pipeline
    rows = []
    for i in range(rounds + 1):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            runtime.overlap_pairs = mode == "overlapped"
            runtime.dispatch.use(mode != "serial-a2a")
            before = runtime.pair_overlap()
            t0 = time.perf_counter()
            trainer.train_one_step()
            seconds = time.perf_counter() - t0
            after = runtime.pair_overlap()
            if i > 0:  # the first round warms both up
                rows.append({"mode": mode, "round": i, "s": seconds, "paired": _delta(after, before),
                             "step": _delta(after["step"], before["step"])})
    return rows


def quartiles(xs: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return f"{q2:.3f} ({q1:.3f}-{q3:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    with World(4, timeout_s=1800) as world:
        per_rank = world.run(run_rounds, _overrides(args), tempfile.mkdtemp(), args.rounds)
    load.append(os.getloadavg()[0])
    print(f"dualpipev p=2 m={args.microbatches}, ep=2 over dp=2, tiny-moe {args.layers} layers hidden {args.hidden}, "
          f"{args.batch} x {args.seq} tokens per step, {args.rounds} rounds; load average "
          f"{' -> '.join(f'{x:.1f}' for x in load)}")
    figures = {mode: {"paired": [], "step": [], "exposed_ms": [], "s": []} for mode in MODES}
    for k, row in enumerate(per_rank[0]):
        rows = [r[k] for r in per_rank]  # the same step on every rank
        f = figures[row["mode"]]
        for what in ("paired", "step"):
            flight = sum(r[what]["in_flight_s"] for r in rows)
            f[what].append(sum(r[what]["hidden_s"] for r in rows) / flight if flight else 0.0)
        f["exposed_ms"].append(1e3 * sum(r["step"]["in_flight_s"] - r["step"]["hidden_s"] for r in rows) / len(rows))
        f["s"].append(max(r["s"] for r in rows))
    print(f"{'':12}{'hidden, paired exchanges':>28}{'hidden, every exchange':>26}{'exposed ms/rank':>22}{'step s':>22}")
    for mode in MODES:
        f = figures[mode]
        logged = mode != "serial-a2a"  # the blocking all_to_all logs no exchange times: waited from issue to end
        cells = [quartiles(f[k]) if logged else "-" for k in ("paired", "step", "exposed_ms")]
        print(f"{mode:12}{cells[0]:>28}{cells[1]:>26}{cells[2]:>22}{quartiles(f['s']):>22}")
    for mode in ("serial", "serial-a2a"):
        ratios = [s / o for s, o in zip(figures[mode]["s"], figures["overlapped"]["s"])]
        print(f"step time {mode} / overlapped, per round: {quartiles(ratios)} (median (q1-q3))")


if __name__ == "__main__":
    main()
