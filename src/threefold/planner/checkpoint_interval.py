"""How often to checkpoint: the Young/Daly interval and the time lost to failures and saves.

A job on N GPUs, each failing independently with mean time between failures M_gpu, fails as a
whole with MTBF M = M_gpu / N (exponential inter-failure times). It saves a checkpoint every tau
seconds of work at a cost of C seconds (the stall), and after a failure it pays R seconds to
restart and redoes the work since the last completed save. Under these assumptions the expected
wall time of one segment (tau of work + one save) is exactly (Daly 2006, eq. 13 with R)

    E(tau) = (M + R) (exp((tau + C) / M) - 1),

so the fraction of wall time that is not useful work is 1 - tau / E(tau). Young (1974) minimised
the first-order expansion: tau = sqrt(2 C M); Daly (2006, eq. 37) the higher-order one:
tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C for C < 2M, else M. `advise` reports both
and the numerical minimiser of E(tau)/tau, which is what it recommends.

A brute-force simulation of failures and saves (`simulate`, used by the tests) checks the
formula: it draws every GPU's failure clock, runs the job segment by segment and counts the time.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Advice:
    interval_s: float  # seconds of work between saves (the recommendation)
    young_s: float
    daly_s: float
    system_mtbf_s: float
    save_s: float
    restart_s: float
    lost_fraction: float  # expected share of wall time not spent on useful work
    save_fraction: float  # of which: saving
    failure_fraction: float  # of which: redone work and restarts
    every_steps: int = 0  # the interval in optimizer steps, when a step time is known

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        steps = f"every {self.every_steps} steps (" if self.every_steps else "every "
        close = ")" if self.every_steps else ""
        return (f"checkpoint {steps}{_duration(self.interval_s)} of work{close}: expected "
                f"{self.lost_fraction:.1%} of the time lost ({self.save_fraction:.1%} saving, "
                f"{self.failure_fraction:.1%} redone work and restarts); save {_duration(self.save_s)}, "
                f"restart {_duration(self.restart_s)}, job MTBF {_duration(self.system_mtbf_s)} "
                f"(Young {_duration(self.young_s)}, Daly {_duration(self.daly_s)})")


def _duration(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


def expected_segment_s(tau: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected wall time to complete tau seconds of work and its save."""
    return (mtbf_s + restart_s) * math.expm1((tau + save_s) / mtbf_s)


def lost_fraction(tau: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    return 1.0 - tau / expected_segment_s(tau, save_s, mtbf_s, restart_s)


def young(save_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def optimal_interval(save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The tau minimising E(tau)/tau (golden-section search on log tau; the function is unimodal)."""
    cost = lambda log_tau: expected_segment_s(math.exp(log_tau), save_s, mtbf_s, restart_s) / math.exp(log_tau)
    lo, hi = math.log(max(1e-9, young(save_s, mtbf_s)) / 100), math.log(max(1e-9, young(save_s, mtbf_s)) * 100)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if cost(a) < cost(b):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


def advise(save_s: float, mtbf_hours_per_gpu: float, gpus: int, restart_s: float = 0.0,
           step_s: float = 0.0) -> Advice:
    """The checkpoint interval for `gpus` GPUs of the given MTBF each, a save stall of `save_s`
    seconds and a restart cost of `restart_s`; with `step_s`, also in optimizer steps."""
    mtbf = mtbf_hours_per_gpu * 3600 / gpus
    tau = optimal_interval(save_s, mtbf, restart_s)
    steps = max(1, round(tau / step_s)) if step_s > 0 else 0
    if steps:
        tau = steps * step_s  # the interval actually used
    total = lost_fraction(tau, save_s, mtbf, restart_s)
    save_share = save_s / expected_segment_s(tau, save_s, mtbf, restart_s)
    return Advice(tau, young(save_s, mtbf), daly(save_s, mtbf), mtbf, save_s, restart_s, total, save_share,
                  total - save_share, steps)


def simulate(tau: float, save_s: float, mtbf_hours_per_gpu: float, gpus: int, restart_s: float = 0.0,
             segments: int = 100_000, seed: int = 0) -> float:
    """Brute force: run `segments` segments of tau seconds of work + a save on `gpus` GPUs whose
    failure clocks are drawn one by one; a failure (during work or save) costs the restart and
    the segment starts over. Returns the fraction of wall time that was not useful work."""
    rng = random.Random(seed)
    per_gpu = mtbf_hours_per_gpu * 3600

    def next_failure() -> float:  # the first of the GPUs' failure clocks (memoryless: redrawn each time)
        return min(rng.expovariate(1 / per_gpu) for _ in range(gpus))

    wall, segment = 0.0, tau + save_s
    until_failure = next_failure()
    for _ in range(segments):
        while until_failure < segment:  # fails before the save completes: lose it, restart
            wall += until_failure + restart_s
            until_failure = next_failure()
        wall += segment
        until_failure -= segment
    return 1.0 - segments * tau / wall
