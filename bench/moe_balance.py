"""Expert balance: DeepSeek-V3's bias rule (`model.router_balance=bias`) against the auxiliary loss (`aux`).

A tiny mixture of experts (`tiny-moe` widened to 8 experts of 48, top-2, hidden 64) trains on the
Python standard library (`data.source=stdlib`, bytes) with the same data order, steps and learning rate
under each rule, for each seed. Printed per run, over the last `--window` steps (default: the last half):
the imbalance max / mean of the tokens per expert (the `moe` metrics: kept assignments per expert, every
sparse block's experts together; 1.0 is perfect balance) and the cross-entropy (the logged loss less
`moe.aux_loss`, so the rules are compared on the language-model loss alone); then per rule the means over
seeds (with their spread) and whether it meets the target against `aux`: imbalance at most aux's at a
cross-entropy at most aux's. `aux`: router_aux_weight 0.01 (the default); `bias R`: rate R, sequence-wise
loss weight (alpha) 0.0001 (the default) unless the name says `alpha A`. The expert load over training of
the first seed's runs (running mean of 10 steps) is plotted to `--plot` (docs/images/moe_balance.png).
One torch thread per run (`run.threads=1`: on a loaded machine spinning threads cost more than they
give); `--jobs N` runs N of them side by side.

    PYTHONPATH=src nice -n 2 python bench/moe_balance.py --steps 400 --seeds 3 --jobs 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODEL = ["model.preset=tiny-moe", "model.hidden=64", "model.experts=8", "model.experts_top_k=2",
         "model.expert_ffn_hidden=48", "model.layers=2"]
BIAS = ["model.router_balance=bias"]
RULES = {"aux": ["model.router_balance=aux"],
         "bias 0.001": BIAS,
         "bias 0.003": [*BIAS, "model.router_bias_rate=0.003"],
         "bias 0.005": [*BIAS, "model.router_bias_rate=0.005"],
         "bias 0.01": [*BIAS, "model.router_bias_rate=0.01"],
         "bias 0.003 alpha 0.001": [*BIAS, "model.router_bias_rate=0.003", "model.router_seq_aux_weight=0.001"],
         "bias 0.005 alpha 0.001": [*BIAS, "model.router_bias_rate=0.005", "model.router_seq_aux_weight=0.001"]}
DEFAULT_RULES = "aux,bias 0.001,bias 0.003,bias 0.005,bias 0.003 alpha 0.001"


def train_run(rule: list[str], steps: int, seed: int, out: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    from threefold.config import load_config
    from threefold.train.trainer import train

    cfg = load_config(None, [*MODEL, *rule, "data.source=stdlib", f"train.steps={steps}", f"train.seed={seed}",
                             "train.global_batch=16", "train.seq_len=64", "train.lr=3e-3", "train.warmup_steps=10", "run.threads=1",
                             f"run.out={out}", "run.progress=false", "run.plot=false", *extra])
    with contextlib.redirect_stderr(io.StringIO()):
        return train(cfg)


def imbalance(row: dict) -> float:
    return row["moe"]["tokens_per_expert"]["max"] / row["moe"]["tokens_per_expert"]["mean"]


def summary(rows: list[dict], window: int = 0) -> tuple[float, float]:
    """Means over the last `window` steps (0: the last half): max / mean tokens per expert, cross-entropy."""
    tail = rows[-window:] if window else rows[len(rows) // 2:]
    return (statistics.mean(imbalance(r) for r in tail),
            statistics.mean(r["loss"] - r["moe"]["aux_loss"] for r in tail))


def one_run(name: str, steps: int, seed: int, tmp: str, window: int) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    rows = train_run(RULES[name], steps, seed, Path(tmp) / f"{name}-{seed}".replace(" ", "-"))
    load, ce = summary(rows, window)
    return {"rule": name, "seed": seed, "imbalance": load, "ce": ce, "cpu_s": time.process_time() - cpu,
            "wall_s": time.perf_counter() - start,
            "curve": [(r["step"], imbalance(r), r["loss"] - r["moe"]["aux_loss"]) for r in rows]}


def report(runs: list[dict], names: list[str], seeds: int) -> dict[str, dict]:
    """Per rule: means and spreads over seeds, each seed's figures, and the target against aux."""
    table = {}
    for name in names:
        mine = sorted((r for r in runs if r["rule"] == name), key=lambda r: r["seed"])
        loads, ces = [r["imbalance"] for r in mine], [r["ce"] for r in mine]
        table[name] = {"imbalance": statistics.mean(loads), "ce": statistics.mean(ces),
                       "imbalance_std": statistics.pstdev(loads), "ce_std": statistics.pstdev(ces),
                       "seeds": [(r["imbalance"], r["ce"]) for r in mine]}
    aux = table.get("aux")
    for name, t in table.items():
        verdict = "" if aux is None or name == "aux" else (
            "  meets the target" if t["imbalance"] <= aux["imbalance"] and t["ce"] <= aux["ce"] else "  misses")
        print(f"  {name:>22}: max/mean load {t['imbalance']:.3f} (std {t['imbalance_std']:.3f})  "
              f"cross-entropy {t['ce']:.4f} (std {t['ce_std']:.4f})  seeds: "
              + ", ".join(f"{load:.3f}/{ce:.4f}" for load, ce in t["seeds"]) + verdict, flush=True)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--window", type=int, default=0, help="steps averaged at the end (0: the last half)")
    p.add_argument("--rules", default=DEFAULT_RULES, help=f"comma-separated, of: {', '.join(RULES)}")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (one process each)")
    p.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" / "images" / "moe_balance.png"))
    p.add_argument("--json", default="", help="write every run's figures and curves to this file")
    a = p.parse_args()
    names = [n.strip() for n in a.rules.split(",")]
    unknown = [n for n in names if n not in RULES]
    if unknown:
        p.error(f"--rules: unknown {unknown}; choose from {list(RULES)}")
    window = a.window or a.steps - a.steps // 2
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(a.jobs) as pool:
        futures = [pool.submit(one_run, name, a.steps, seed, tmp, a.window) for seed in range(a.seeds) for name in names]
        runs = []
        for f in futures:
            runs.append(f.result())
            r = runs[-1]
            print(f"seed {r['seed']} {r['rule']:>22}: max/mean load {r['imbalance']:.3f}  cross-entropy {r['ce']:.4f}  "
                  f"({r['cpu_s']:.0f} s CPU)", flush=True)
            if len(runs) % len(names) == 0:  # a seed is complete: the table so far (a long sweep can be cut short)
                seeds = len(runs) // len(names)
                print(f"over {seeds} seeds x {a.steps} steps (last {window} steps averaged; "
                      f"{sum(r['cpu_s'] for r in runs):.0f} s of CPU in all):", flush=True)
                table = report(runs, names, seeds)
                if a.json:
                    Path(a.json).write_text(json.dumps({"args": vars(a), "table": table, "runs": runs}))
                if a.plot:
                    plot({r["rule"]: r["curve"] for r in runs if r["seed"] == 0}, Path(a.plot))


def smooth(values: list[float], n: int = 10) -> list[float]:
    return [statistics.mean(values[max(0, i - n + 1): i + 1]) for i in range(len(values))]


def plot(curves: dict[str, list[tuple[int, float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, ce) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, rows in curves.items():
        steps = [r[0] for r in rows]
        load.plot(steps, smooth([r[1] for r in rows]), label=name, lw=1)
        late = len(rows) // 4  # the cross-entropy after its first fall, where the rules differ
        ce.plot(steps[late:], smooth([r[2] for r in rows])[late:], label=name, lw=1)
    load.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load (seed 0, mean of 10 steps)")
    ce.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss less the auxiliary losses (seed 0, mean of 10 steps)")
    load.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
