"""`threefold parity`: the same job under several layouts, compared step by step.

    threefold parity --layouts "1,1,1 2,1,1 1,2,1 1,1,2 2,2,2" --steps N [train options]

Each layout "dp,tp,pp" runs as its own local world of dp*tp*pp processes (launch/local.py; a world of
one runs in the harness's own process), from the
same seed - so the same initial weights and the same global batches (the contract of
docs/architecture.md) - into DIR/layout-D-T-P/, writing its metrics and, at the end, the
parameter boxes each rank owns (debug.dump_params, observe/params.py). The harness then compares
every layout with the first:

* the loss of every step: relative difference |l - l_ref| / |l_ref|;
* every parameter after the last step, reassembled from the placements: norm-wise relative
  difference ||p - p_ref|| / ||p_ref||.

Tolerances (`--loss-rtol`, `--param-rtol`), by compute precision when not given:

    precision   loss    parameters
    fp32        1e-5    1e-4        reassociation of fp32 sums; AdamW (eps 1e-8) amplifies the
                                    noise of near-zero gradients, hence the looser parameter bound
    bf16/fp16   2e-2    5e-2        a few units of the 8-/11-bit mantissa

The verdict: exit 0 when every layout is within them; exit 1 naming the first layout and step
that is not (or the layout whose run failed); exit 2 for a mistake in the options.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..launch.local import launch_local
from ..layout import Layout
from ..observe.params import load_global
from ..observe.plots import read_metrics

TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, 5e-2), "fp16": (2e-2, 5e-2)}
_TRAIN_OWNED = {"dp", "tp", "pp", "out"}  # set by the harness, not by the user


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .command import FLAG_KEYS, OPTION_KEYS

    p.add_argument("--layouts", required=True, metavar='"D,T,P ..."',
                   help='layouts to compare, the first is the reference, e.g. "1,1,1 2,1,1 1,2,1"')
    p.add_argument("--out", default="runs/parity", help="directory of the runs (one sub-directory per layout)")
    p.add_argument("--loss-rtol", type=float, help="relative loss tolerance per step (default by precision)")
    p.add_argument("--param-rtol", type=float, help="norm-wise parameter tolerance (default by precision)")
    p.add_argument("--config", help="TOML file with any config key; the options below override it")
    for option, key in OPTION_KEYS.items():
        if option not in _TRAIN_OWNED:
            p.add_argument("--" + option.replace("_", "-"), dest=option, metavar="V", help=f"sets {key}")
    for option, key in FLAG_KEYS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, action="store_true", help=f"sets {key}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, repeatable, e.g. --set model.layers=4")


def _overrides(args: argparse.Namespace) -> list[str]:
    from .command import FLAG_KEYS, OPTION_KEYS

    out = [f"{key}={getattr(args, o)}" for o, key in OPTION_KEYS.items()
           if o not in _TRAIN_OWNED and getattr(args, o, None) is not None]
    out += [f"{key}=true" for o, key in FLAG_KEYS.items() if getattr(args, o)]
    return out + list(args.overrides)


def parse_layouts(text: str) -> list[Layout]:
    layouts = [Layout.parse(item, "--layouts", cp=False) for item in text.split()]
    if len(layouts) < 2:
        raise UserError('--layouts: give at least two layouts to compare, e.g. "1,1,1 2,1,1"')
    if len(set(layouts)) != len(layouts):
        raise UserError(f"--layouts: '{text}' repeats a layout")
    return layouts


def name(layout: Layout) -> str:
    return layout.text


def sizes(layout: Layout) -> list[str]:
    """The layout as the config's keys."""
    return [f"parallel.{axis}={size}" for axis, size in layout.fields().items()]


def run_layout(layout: Layout, overrides: list[str], config: str | None, out: Path) -> int:
    world = layout.world_size
    cfg = load_config(config, [*overrides, *sizes(layout), f"run.out={out}", "debug.dump_params=true",
                               "run.plot=false", "run.progress=false"]).validate(world)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl",):
        (out / stale).unlink(missing_ok=True)
    for stale in (out / "params").glob("rank-*.safetensors"):
        stale.unlink()
    (out / "config.toml").write_text(cfg.to_toml())
    if world == 1:
        return _run_here(cfg)
    return launch_local(world, ["train", "--config", str(out / "config.toml")],
                        hang_report=out / "flight" / "hang-report.txt")


def _run_here(cfg) -> int:
    """A world of one runs in this process: no communication to launch, one interpreter start saved."""
    import os
    import traceback

    import torch.distributed as dist

    from .trainer import train

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    try:
        train(cfg)
        return 0
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():  # the launcher of the next layouts must not see a world here
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


def param_rel(a, b) -> float:
    a, b = a.double(), b.double()
    denom = float(b.norm())
    diff = float((a - b).norm())
    return diff / denom if denom > 0 else diff


def compare(reference: dict, other: dict, loss_rtol: float, param_rtol: float) -> dict:
    """Differences of one layout's run against the reference run, and its first failure."""
    ref_loss, loss = reference["losses"], other["losses"]
    steps = [(i + 1, rel(b, a)) for i, (a, b) in enumerate(zip(ref_loss, loss))]
    failure = None
    if len(loss) != len(ref_loss):
        failure = (min(len(loss), len(ref_loss)) + 1,
                   f"ran {len(loss)} steps, the reference {len(ref_loss)}")
    for step, diff in steps:
        if not diff <= loss_rtol:
            failure = failure or (step, f"loss {loss[step - 1]:.8g} vs {ref_loss[step - 1]:.8g}: relative "
                                        f"difference {diff:.2e} > {loss_rtol:.0e}")
            break
    params = {}
    for key, ref in reference["params"].items():
        if key not in other["params"]:
            params[key] = math.inf
        elif tuple(other["params"][key].shape) != tuple(ref.shape):
            params[key] = math.inf
        else:
            params[key] = param_rel(other["params"][key], ref)
    if failure is None:
        worst = max(params, key=params.get) if params else None
        if worst is not None and not params[worst] <= param_rtol:
            failure = (len(ref_loss), f"parameter {worst} differs by {params[worst]:.2e} > {param_rtol:.0e} "
                                      "after the last step")
    return {"steps": steps, "params": params, "failure": failure}


def load_run(out: Path) -> dict:
    return {"losses": [row["loss"] for row in read_metrics(out / "metrics.jsonl")],
            "params": load_global(out / "params")}


def report(layouts, results: dict, loss_rtol: float, param_rtol: float, precision: str) -> list[str]:
    ref = name(layouts[0])
    others = [name(layout) for layout in layouts[1:] if name(layout) in results]
    lines = [f"parity against layout {ref} (dp,tp,pp); tolerances: loss {loss_rtol:.0e} per step, "
             f"parameters {param_rtol:.0e} norm-wise ({precision})", "",
             f"{'step':>5} {'loss ' + ref:>16} " + " ".join(f"{'rel diff ' + o:>16}" for o in others)]
    ref_losses = results[ref]["losses"]
    for i, loss in enumerate(ref_losses):
        diffs = " ".join(f"{results[o]['compare']['steps'][i][1]:>16.2e}"
                         if i < len(results[o]["compare"]["steps"]) else f"{'-':>16}" for o in others)
        lines.append(f"{i + 1:>5} {loss:>16.8f} {diffs}")
    lines += ["", f"parameters after step {len(ref_losses)}, norm-wise relative difference:"]
    width = max((len(k) for k in results[ref]["params"]), default=10)
    lines.append(f"{'tensor':<{width}} " + " ".join(f"{o:>12}" for o in others))
    for key in results[ref]["params"]:
        lines.append(f"{key:<{width}} " + " ".join(f"{results[o]['compare']['params'][key]:>12.2e}" for o in others))
    return lines


def run(args: argparse.Namespace) -> int:
    layouts = parse_layouts(args.layouts)
    overrides = _overrides(args)
    base = load_config(args.config, overrides)
    from ..mesh import pick_device

    compute = base.precision.for_device(pick_device(base.run.device).type).compute  # `auto` as the runs settle it
    default_loss, default_param = TOLERANCES[compute]
    loss_rtol = args.loss_rtol if args.loss_rtol is not None else default_loss
    param_rtol = args.param_rtol if args.param_rtol is not None else default_param
    root = Path(args.out)
    for layout in layouts:  # every layout's config is checked before anything runs
        load_config(args.config, [*overrides, *sizes(layout)]).validate(layout.world_size)
    results, failures = {}, []
    for layout in layouts:
        out = root / f"layout-{layout.dp}-{layout.tp}-{layout.pp}"
        print(f"threefold parity: running layout {name(layout)} ({layout.world_size} processes) "
              f"in {out}", flush=True)
        code = run_layout(layout, overrides, args.config, out)
        if code != 0:
            failures.append((name(layout), None, f"the run failed (exit code {code}); its error is above"))
            if layout == layouts[0]:
                break
            continue
        try:
            results[name(layout)] = load_run(out)
        except (OSError, ValueError) as e:  # no metrics, or placements that do not reassemble
            failures.append((name(layout), None, f"its results cannot be read: {e}"))
            if layout == layouts[0]:
                break
    ref = name(layouts[0])
    if ref in results:
        for layout in layouts[1:]:
            if name(layout) in results:
                outcome = compare(results[ref], results[name(layout)], loss_rtol, param_rtol)
                results[name(layout)]["compare"] = outcome
                if outcome["failure"]:
                    failures.append((name(layout), *outcome["failure"]))
        print("\n".join(report(layouts, results, loss_rtol, param_rtol, compute)))
    print()
    if failures:
        for layout, step, why in failures:
            where = f" at step {step}" if step is not None else ""
            print(f"parity FAILED: layout {layout}{where}: {why}")
        return 1
    print(f"parity PASSED: {len(layouts) - 1} layout(s) match {ref} within the tolerances")
    return 0
