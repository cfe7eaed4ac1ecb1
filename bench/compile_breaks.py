"""Graph breaks of `--compile` per layout: what dynamo captured while training, counted.

    PYTHONPATH=src python bench/compile_breaks.py [--layouts dp,zero1,...] [--steps 2] [--backend aot_eager]

Each layout trains the `tiny-llama` model (`tiny-moe` for moe) for `--steps` steps on a world of
2 gloo processes with `train.compile=true`, after `torch._dynamo.reset()`, and reads dynamo's own
counters (`torch._dynamo.utils.counters`): the graphs it compiled (`unique_graphs`: one per piece
between two breaks, and one more per recompilation) and every graph break with its reason, the
function dynamo stopped at. Printed as a markdown table (rank 0; every rank compiles the same).
`aot_eager` captures the same graphs as inductor, without generating code (seconds, not minutes).
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile

BASE = ["model.preset=tiny-llama", "train.global_batch=4", "train.seq_len=16", "run.progress=false",
        "run.plot=false"]
LAYOUTS = {
    "dp": ["parallel.dp=2"],
    "zero1": ["parallel.dp=2", "parallel.zero=1"],
    "zero2": ["parallel.dp=2", "parallel.zero=2"],
    "zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp": ["parallel.tp=2"],
    "tp+sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp+sp+selective remat": ["parallel.tp=2", "parallel.sequence_parallel=true", "remat.policy=selective"],
    "dp+full remat": ["parallel.dp=2", "remat.policy=full"],
    "pp": ["parallel.pp=2"],
    "pp zb-h1": ["parallel.pp=2", "pipeline.schedule=zb-h1"],
    "moe ep=2": ["model.preset=tiny-moe", "parallel.dp=2", "parallel.ep=2"],
}


def short_reason(reason: str) -> str:
    """The function dynamo stopped at ('Comm.all_gather'), or the reason's first line."""
    found = re.search(r"Skip inlining function <function ([\w.]+)", reason)
    return found.group(1) if found else reason.strip().splitlines()[0][:80]


def count_breaks(out: str, overrides: list[str], steps: int, backend: str) -> dict:
    """Train `steps` steps compiled with `backend` from a clean dynamo; its counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(None, [f"run.out={out}", *BASE, *overrides, f"train.steps={steps}", "train.compile=true",
                             f"debug.compile_backend={backend}"])
    Trainer(cfg).run()
    reasons = collections.Counter()
    for reason, n in counters["graph_break"].items():
        reasons[short_reason(reason)] += n
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(reasons.values()), "reasons": dict(reasons)}


def table(rows: dict) -> str:
    lines = ["| layout | graphs | graph breaks | where dynamo stopped (count) |", "|---|---|---|---|"]
    for name, r in rows.items():
        where = ", ".join(f"`{k}` ({n})" for k, n in sorted(r["reasons"].items())) or "-"
        lines.append(f"| {name} | {r['graphs']} | {r['breaks']} | {where} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    from threefold.launch.world import World

    rows = {}
    with World(2, timeout_s=900) as world:
        for name in args.layouts.split(","):
            rows[name] = world.run(count_breaks, tempfile.mkdtemp(), LAYOUTS[name], args.steps, args.backend)[0]
    print(table(rows))


if __name__ == "__main__":
    main()
