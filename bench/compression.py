"""Gradient compression: bytes per step and convergence of every method against the dense run.

Trains the reference model on the stdlib corpus with each compression method (and with error
feedback / momentum correction switched off) on N processes, same seed, data and schedule.
Prints one row per run: gradient bytes this rank sent over dp per step once compression is
on (counted by Comm: values, indices, scales), the ratio to the dense fp32 all-reduce, and
the final loss (mean of the last 20 steps) against the uncompressed run. Writes the loss
curves to bench/out/compression.png and the figures to bench/out/compression.json.

    python bench/compression.py [--steps 300] [--nproc 4] [--model tiny] [--only none dgc ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def runs(steps: int) -> dict[str, list[str]]:
    warm = max(1, steps // 5)  # 1-bit Adam's uncompressed warm-up: 20% of the run
    dgc = ["compress.method=dgc", f"compress.dgc_warmup_steps={warm}"]
    onebit = ["compress.method=onebit", f"compress.warmup_steps={warm}"]
    sign = ["compress.method=onebit", "compress.onebit_adam=false"]
    powersgd = ["compress.method=powersgd", "compress.powersgd_rank=4"]
    return {
        "none": [], "fp16": ["compress.method=fp16"], "bf16": ["compress.method=bf16"],
        "dgc 90%": dgc + ["compress.dgc_sparsity=0.9"],
        "dgc 90% no-momentum-corr": dgc + ["compress.dgc_sparsity=0.9", "compress.dgc_momentum_correction=false"],
        "dgc 90% no-error-feedback": dgc + ["compress.dgc_sparsity=0.9", "compress.error_feedback=false"],
        "dgc 99%": dgc + ["compress.dgc_sparsity=0.99"],
        "dgc 99% no-momentum-corr": dgc + ["compress.dgc_sparsity=0.99", "compress.dgc_momentum_correction=false"],
        "dgc 99% no-error-feedback": dgc + ["compress.dgc_sparsity=0.99", "compress.error_feedback=false"],
        "dgc 99.9%": dgc + ["compress.dgc_sparsity=0.999"],
        "1-bit adam": onebit, "1-bit adam no-error-feedback": onebit + ["compress.error_feedback=false"],
        "1-bit sign": sign, "1-bit sign no-error-feedback": sign + ["compress.error_feedback=false"],
        "powersgd r4": powersgd, "powersgd r4 no-error-feedback": powersgd + ["compress.error_feedback=false"],
    }


def train_one(overrides: list[str], out: str) -> dict:
    """On every rank: train; return the losses and this rank's gradient bytes over dp per step."""
    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    cfg = load_config(None, [f"run.out={out}", "run.progress=false", "run.plot=false", *overrides])
    start = time.perf_counter()
    records = Trainer(cfg).run()
    grad_bytes = [sum(n for op, n in r["comm"].get("dp", {}).items() if "." not in op) for r in records]
    return {"losses": [r["loss"] for r in records], "grad_bytes": grad_bytes, "seconds": time.perf_counter() - start}


def final(losses: list[float], window: int = 20) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for name, res in results.items():
        losses = res["losses"]
        smooth = [sum(losses[max(0, i - 9): i + 1]) / len(losses[max(0, i - 9): i + 1]) for i in range(len(losses))]
        style = "--" if "no-" in name else "-"
        ax.plot(range(1, len(losses) + 1), smooth, style, label=name, linewidth=2.2 if name == "none" else 1.2,
                color="black" if name == "none" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (10-step mean)")
    ax.set_title("gradient compression: loss curves (dashed: mechanism switched off)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra config overrides")
    parser.add_argument("--only", nargs="+", help="names of the runs to do (default: all)")
    args = parser.parse_args()

    from threefold.world import World

    base = [f"model.preset={args.model}", f"train.steps={args.steps}", f"train.global_batch={args.global_batch}",
            f"train.seq_len={args.seq_len}", f"train.lr={args.lr}", f"train.warmup_steps={args.steps // 20}",
            "data.source=stdlib", *args.extra]
    todo = {k: v for k, v in runs(args.steps).items() if not args.only or k in args.only or k == "none"}
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    with World(args.nproc, timeout_s=3600) as world:
        for name, overrides in todo.items():
            results[name] = world.run(train_one, base + overrides, str(OUT / "runs"))[0]
            print(f"  {name}: {results[name]['seconds']:.0f} s", flush=True)

    dense_bytes = results["none"]["grad_bytes"][-1]
    reference = final(results["none"]["losses"])
    print(f"\n{args.model}, {args.nproc} processes, {args.steps} steps, global batch {args.global_batch} x "
          f"{args.seq_len} tokens, stdlib corpus; final loss = mean of the last 20 steps\n")
    print(f"{'method':32} {'bytes/step':>11} {'vs dense':>9} {'final loss':>11} {'vs none':>8}")
    table = []
    for name, res in results.items():
        sent = res["grad_bytes"][-1]
        loss = final(res["losses"])
        row = {"method": name, "bytes_per_step": sent, "compression": dense_bytes / sent if sent else float("inf"),
               "final_loss": loss, "loss_change_pct": 100 * (loss - reference) / reference}
        table.append(row)
        print(f"{name:32} {sent:>11,} {row['compression']:>8.1f}x {loss:>11.4f} {row['loss_change_pct']:>+7.2f}%")
    (OUT / "compression.json").write_text(json.dumps({"args": vars(args), "table": table,
                                                      "losses": {k: v["losses"] for k, v in results.items()}}))
    plot(results, OUT / "compression.png")
    print(f"\ncurves: {OUT / 'compression.png'}")


if __name__ == "__main__":
    main()
