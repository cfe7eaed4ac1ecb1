"""`threefold runs ...`: questions about a run directory after the fact.

`runs goodput DIR`: where the run's wall time went, over every attempt that trained in DIR
(restarts and resumes included), from DIR/goodput.json and DIR/metrics.jsonl (observe/goodput.py):
a table of seconds and shares per category, one column per attempt; `--json` prints the breakdown
as JSON. Plain Python: no torch is imported.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UserError
from ..observe.goodput import CATEGORIES, GOODPUT_FILE, LABELS, run_breakdown


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="runs_command", required=True)
    good = sub.add_parser("goodput", help="where a run's wall time went, over its attempts (DIR/goodput.json)")
    good.add_argument("dir", metavar="DIR", help="a run directory (its goodput.json and metrics.jsonl)")
    good.add_argument("--json", action="store_true", help="print the breakdown as JSON")


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if not (out / GOODPUT_FILE).is_file():
        raise UserError(f"runs goodput: '{out / GOODPUT_FILE}' does not exist; give the directory of a run "
                        "(its --out) that has trained at least one step")
    result = run_breakdown(out)
    if args.json:
        print(json.dumps({"dir": str(out), **result}, indent=1))
        return 0
    print(table(out, result))
    return 0


def _steps(row: dict) -> str:
    steps = f"steps {row['steps'][0]}-{row['steps'][1]}" if row["steps"] else "no step kept"
    lost = row["recomputed_steps"]
    return steps + (f", steps {lost[0]}-{lost[-1]} recomputed by the next" if lost else "")


def table(out: Path, result: dict) -> str:
    """The breakdown as text: one row per category (seconds, share of the wall time, then each attempt's seconds)."""
    total, rows = result["total"], result["attempts"]
    lines = [f"{out}: {total['wall_s']:.3f} s of wall time over {len(rows)} attempt{'s' if len(rows) != 1 else ''}"]
    head = f"{'':<12}{'seconds':>10}{'share':>8}" + "".join(f"{'#' + str(r['attempt']):>10}" for r in rows)
    lines.append(head)
    for key in CATEGORIES:
        lines.append(f"{LABELS[key]:<12}{total['seconds'][key]:>10.3f}{total['fractions'][key]:>8.1%}"
                     + "".join(f"{r['seconds'][key]:>10.3f}" for r in rows))
    lines.append(f"{'wall':<12}{total['wall_s']:>10.3f}{1 if total['wall_s'] > 0 else 0:>8.1%}"
                 + "".join(f"{r['wall_s']:>10.3f}" for r in rows))
    lines += [f"#{r['attempt']}: {r['outcome']}, {_steps(r)}" for r in rows]
    return "\n".join(lines)
