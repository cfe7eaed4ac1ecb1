"""Expert balance: DeepSeek-V3's bias rule (`model.router_balance=bias`) against the auxiliary loss (`aux`).

A tiny mixture of experts (`tiny-moe` widened to 8 experts of 48, top-2, hidden 64) trains on the
Python standard library (`data.source=stdlib`, bytes) with the same data order, steps and learning rate
under each rule, for each seed. Printed per run, over the last half of the steps: the imbalance max / mean
of the tokens per expert (the `moe` metrics: kept assignments per expert, every sparse block's experts
together; 1.0 is perfect balance) and the cross-entropy (the logged loss less `moe.aux_loss`, so the
two rules are compared on the language-model loss alone). `aux`: router_aux_weight 0.01 (the default);
`bias`: rate 0.001 (the default) and 0.01, sequence-wise loss weight 0.0001 (the default). The expert
load over training of the first seed's runs is plotted to `--plot` (docs/images/moe_balance.png). One
torch thread per run (`run.threads=1`: on a loaded machine spinning threads cost more than they give).

    PYTHONPATH=src nice -n 2 python bench/moe_balance.py --steps 200 --seeds 2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
from pathlib import Path

MODEL = ["model.preset=tiny-moe", "model.hidden=64", "model.experts=8", "model.experts_top_k=2",
         "model.expert_ffn_hidden=48", "model.layers=2"]
RULES = {"aux": ["model.router_balance=aux"],
         "bias 0.001": ["model.router_balance=bias"],
         "bias 0.01": ["model.router_balance=bias", "model.router_bias_rate=0.01"]}


def train_run(rule: list[str], steps: int, seed: int, out: Path) -> list[dict]:
    from threefold.config import load_config
    from threefold.train.trainer import train

    cfg = load_config(None, [*MODEL, *rule, "data.source=stdlib", f"train.steps={steps}", f"train.seed={seed}",
                             "train.global_batch=16", "train.seq_len=64", "train.lr=3e-3", "train.warmup_steps=10", "run.threads=1",
                             f"run.out={out}", "run.progress=false", "run.plot=false"])
    with contextlib.redirect_stderr(io.StringIO()):
        return train(cfg)


def summary(rows: list[dict]) -> tuple[float, float]:
    """Mean over the last half of the steps: max / mean tokens per expert, and the cross-entropy."""
    tail = rows[len(rows) // 2:]
    imbalance = statistics.mean(r["moe"]["tokens_per_expert"]["max"] / r["moe"]["tokens_per_expert"]["mean"]
                                for r in tail)
    ce = statistics.mean(r["loss"] - r["moe"]["aux_loss"] for r in tail)
    return imbalance, ce


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" / "images" / "moe_balance.png"))
    a = p.parse_args()
    table: dict[str, list[tuple[float, float]]] = {name: [] for name in RULES}
    curves: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seeds):
            for name, rule in RULES.items():
                rows = train_run(rule, a.steps, seed, Path(tmp) / f"{name}-{seed}".replace(" ", "-"))
                table[name].append(summary(rows))
                curves.setdefault(name, rows)
                print(f"seed {seed} {name:>10}: max/mean load {table[name][-1][0]:.3f}  "
                      f"cross-entropy {table[name][-1][1]:.4f}", flush=True)
    print(f"over {a.seeds} seeds x {a.steps} steps (last {a.steps - a.steps // 2} steps averaged):")
    for name, values in table.items():
        print(f"  {name:>10}: max/mean load {statistics.mean(v[0] for v in values):.3f}  "
              f"cross-entropy {statistics.mean(v[1] for v in values):.4f}")
    plot(curves, Path(a.plot))


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, ce) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        load.plot(steps, [r["moe"]["tokens_per_expert"]["max"] / r["moe"]["tokens_per_expert"]["mean"] for r in rows],
                  label=name, lw=1)
        ce.plot(steps, [r["loss"] - r["moe"]["aux_loss"] for r in rows], label=name, lw=1)
    load.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load (seed 0)")
    ce.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss less the auxiliary losses")
    load.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
