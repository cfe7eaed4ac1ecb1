"""Where a ZeRO step's time goes: the phases of threefold's step under ZeRO stages, alternating.

Times, on rank 0, the parts of each step by wrapping them from outside (the same wrappers on
every stage, so the instrumentation costs all alike): forward + backward, `finish()` (waiting for
the gradient reduction), the optimizer step and, inside it, the torch optimizer and `after_step`
(ZeRO-1/2: the parameter all-gather, or only marking it due when it overlaps the next forward).
Medians over the timed steps (the first is untimed), alternating rounds, per-round throughput
ratios against the first stage listed.

    python bench/zero_phases.py --stages 0 1 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from threefold.launch.world import World


def timed_run(overrides: list[str]) -> dict:
    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    times: dict[str, list[float]] = {}

    def wrap(obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            times.setdefault(key, []).append(time.perf_counter() - start)
            return out
        setattr(obj, attr, timed)

    trainer = Trainer(load_config(None, overrides + ["run.progress=false", "run.plot=false"]))
    wrap(trainer.parallel, "forward_backward", "forward+backward")
    wrap(trainer.parallel.grad_sync, "finish", "finish")
    optimizer = trainer.optimizer
    if optimizer.after_step is not None:
        wrap(optimizer, "after_step", "after_step")
    wrap(optimizer.inner, "step", "torch optimizer")
    wrap(optimizer, "step", "optimizer step")
    records = trainer.run()
    out = {key: statistics.median(v[1:]) for key, v in times.items()}
    out["step"] = statistics.median(r["step_time_s"] for r in records[1:])
    out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in records[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    common = [f"model.preset={args.model}", f"train.steps={args.steps}", "train.global_batch=8",
              f"train.seq_len={args.seq_len}", "precision.compute=fp32", "data.source=stdlib", "run.out=runs/bench-zero"]
    runs: dict[int, list[dict]] = {s: [] for s in args.stages}
    load = [os.getloadavg()[0]]
    with World(args.nproc, timeout_s=600) as world:
        for r in range(args.rounds):
            for stage in (args.stages if r % 2 == 0 else args.stages[::-1]):
                runs[stage].append(world.run(timed_run, common + [f"parallel.zero={stage}"])[0])
            load.append(os.getloadavg()[0])
    print(f"world {args.nproc}, model {args.model}, {args.rounds} alternating rounds, seconds (median of timed "
          f"steps, rank 0, per round); load average {' -> '.join(f'{x:.1f}' for x in load)}")
    keys = ["step", "forward+backward", "finish", "optimizer step", "torch optimizer", "after_step"]
    print(f"{'stage':6}" + "".join(f"{k:>18}" for k in keys))
    for stage, rs in runs.items():
        for r in rs:
            print(f"ZeRO-{stage:<1} " + "".join(f"{r[k]:18.4f}" if k in r else f"{'-':>18}" for k in keys))
    base = runs[args.stages[0]]
    for stage in args.stages[1:]:
        x = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[stage], base)]
        print(f"ZeRO-{stage} / ZeRO-{args.stages[0]} throughput: {statistics.median(x):.2f}x "
              f"({min(x):.2f}-{max(x):.2f})")


if __name__ == "__main__":
    main()
