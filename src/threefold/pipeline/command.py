"""`threefold schedule`: simulate a pipeline schedule, check it, and draw it.

    threefold schedule --pp 4 --microbatches 8 --schedule zb-h1 --out zb.png [--trace zb.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError
from .draw import chrome_trace, draw_timeline
from ..schedules.registry import DEFAULT_SCHEDULE, SCHEDULES, build_schedule, validate
from .simulate import Costs, simulate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", choices=list(SCHEDULES), default=DEFAULT_SCHEDULE,
                   help="; ".join(f"{k.name}: {k.summary}" for k in SCHEDULES.values()))
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--out", required=True, help="picture to write: FILE.png or FILE.svg")
    p.add_argument("--costs", default="1,1,1", metavar="F,I,W",
                   help="cost of forward, backward-input, backward-weight of one stage (default 1,1,1)")
    p.add_argument("--comm", type=float, default=0.0, help="latency of one transfer, in the same unit")
    p.add_argument("--trace", help="also write a Chrome trace (JSON), one cost unit drawn as 1 ms")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".svg"):
        raise UserError(f"--out: '{out}' must end in .png or .svg")
    if args.pp < 1 or args.microbatches < 1 or args.virtual_stages < 1:
        raise UserError("--pp, --microbatches and --virtual-stages must be at least 1")
    try:
        f, i, w = (float(x) for x in args.costs.split(","))
    except ValueError:
        raise UserError(f"--costs: '{args.costs}' is not three numbers F,I,W, e.g. 1,1,1") from None
    try:
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    except ValueError as e:
        raise UserError(f"--schedule {args.schedule}: {e}") from None
    validate(schedule)
    # v chunks per rank (interleaved's virtual stages, the V schedules' two): each costs 1/v of a rank's layers
    v = schedule.virtual
    sim = simulate(schedule, Costs(f / v, i / v, w / v, args.comm))
    title = f"{args.schedule}  pp={args.pp}  m={args.microbatches}" + (f"  v={v}" if v > 1 else "")
    pairs = SCHEDULES[args.schedule].pairs
    paired = {(r, a) for r in range(args.pp) for pair in pairs(args.pp, args.microbatches, r) for a in pair} \
        if pairs is not None else set()
    draw_timeline(sim.events, args.pp, out, title, unit="time (1 = one rank's forward)", paired=paired)
    print(sim.summary())
    print("bubble per rank: " + " ".join(f"{b:.3f}" for b in sim.bubble))
    print(f"wrote {out}")
    if args.trace:
        print(f"wrote {chrome_trace(sim.events, args.trace, seconds_per_unit=1e-3)}")
    return 0
