"""The pipeline runtime's measured bubble against the simulator's, on the wall clock.

Stages that sleep a fixed time per action (tests/distributed/test_pipeline_bubble.py's
`SleepCompute`: F = I = W = one unit, B = two) run each schedule through the real runtime on 4
gloo processes, several rounds. Per round and schedule: the bubble of the recorded busy
intervals (gaps included, the worst rank) and its ratio to the simulated bubble with unit costs.
The ratios' quartiles over the rounds are printed: 1.00 is the simulator's prediction; a busy
machine stretches the gaps, so the ratios rise with the load (printed before and after). The
pass/fail test asserts the order, messages and activations instead; this is where the time is.

    PYTHONPATH=src:. python bench/pipeline_bubble.py --rounds 5 --unit-ms 40
"""

from __future__ import annotations

import argparse
import os
import statistics

from tests.distributed.test_pipeline_bubble import P, RUNS, run_schedules
from threefold.launch.world import World
from threefold.pipeline.simulate import Costs, simulate
from threefold.pipeline.timeline import bubble_fractions
from threefold.schedules.registry import build_schedule


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return f"{q1:.3f} / {q2:.3f} / {q3:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--unit-ms", type=float, default=40.0, help="one forward's sleep")
    args = ap.parse_args()
    measured: dict[int, list[float]] = {i: [] for i in range(len(RUNS))}
    load = [os.getloadavg()[0]]
    with World(P, timeout_s=1800) as world:
        world.run(run_schedules, [("interleaved", 4, 2)], 0.001)  # opens gloo's connections between all pairs
        for _ in range(args.rounds):
            per_rank = world.run(run_schedules, RUNS, args.unit_ms / 1e3)
            for i in range(len(RUNS)):
                events = [e for runs in per_rank for e in runs[i][0] if e.kind in "FBIW"]
                measured[i].append(max(bubble_fractions(events, P)))
            load.append(os.getloadavg()[0])
    print(f"p={P}, one unit {args.unit_ms:g} ms, {args.rounds} rounds; load average "
          f"{' -> '.join(f'{x:.1f}' for x in load)}")
    print(f"{'schedule':16}{'simulated':>10}{'measured (median)':>19}   measured / simulated: q1 / median / q3")
    for i, (name, m, v) in enumerate(RUNS):
        simulated = max(simulate(build_schedule(name, P, m, v), Costs(1, 1, 1)).bubble)
        ratios = [b / simulated for b in measured[i]]
        print(f"{name + f' m={m}':16}{simulated:10.3f}{statistics.median(measured[i]):19.3f}   {quartiles(ratios)}")


if __name__ == "__main__":
    main()
