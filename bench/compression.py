"""Gradient compression: bytes per step and convergence of every method against the dense run.

Trains the reference model on the stdlib corpus with each compression method (and with error
feedback / momentum correction switched off) on N processes, same seed, data and schedule.
Each method is compared with the uncompressed run *of the optimizer it was designed for*:

    AdamW baseline         fp16, bf16, PowerSGD, 1-bit Adam
    momentum-SGD baseline  DGC (warm-up 75% -> 99.9%), 1-bit sign compression of the gradients

(DGC's momentum correction applies the momentum before the exchange, so the optimizer then
runs SGD without momentum; switched off, the optimizer's momentum acts on the sparse sum.)
Prints one row per run: gradient bytes this rank sent over dp per step once compression is
on (counted by Comm: values, indices, scales), the ratio to the dense fp32 all-reduce, and
the final loss (mean of the last `--window` steps, 20) against its baseline. Writes the loss curves to
bench/out/compression.png and the figures to bench/out/compression.json.

    python bench/compression.py [--steps 300] [--nproc 4] [--model tiny] [--only none dgc ...]
"""

from __future__ import annotations

import argparse
import json

from curves import OUT, add_run_args, base_overrides, done, final, plot, train_one

BASELINES = {"adamw": "adamw none", "sgd": "sgd none"}


def runs(steps: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (optimizer, overrides); the baseline of each optimizer is `<optimizer> none`."""
    warm = max(1, steps // 5)  # uncompressed warm-up (1-bit Adam) / sparsity warm-up (DGC): 20% of the run
    dgc = ["compress.method=dgc", "compress.dgc_sparsity=0.999", f"compress.dgc_warmup_steps={warm}"]
    onebit = ["compress.method=onebit", f"compress.warmup_steps={warm}"]
    sign = ["compress.method=onebit", "compress.onebit_adam=false", f"compress.warmup_steps={warm}"]
    powersgd = ["compress.method=powersgd", "compress.powersgd_rank=4"]
    no_ef = ["compress.error_feedback=false"]
    adamw = {
        "adamw none": [], "fp16": ["compress.method=fp16"], "bf16": ["compress.method=bf16"],
        "powersgd r4": powersgd, "powersgd r4 no-error-feedback": powersgd + no_ef,
        "1-bit adam": onebit, "1-bit adam no-error-feedback": onebit + no_ef,
    }
    sgd = {
        "sgd none": [],
        "dgc 99.9%": dgc, "dgc 99.9% no-momentum-corr": dgc + ["compress.dgc_momentum_correction=false"],
        "dgc 99.9% no-error-feedback": dgc + no_ef,
        "1-bit sign": sign, "1-bit sign no-error-feedback": sign + no_ef,
    }
    return {**{k: ("adamw", v) for k, v in adamw.items()}, **{k: ("sgd", v) for k, v in sgd.items()}}


def style(name: str, res: dict) -> dict:
    base = name in BASELINES.values()
    return {"linestyle": "--" if "no-" in name else "-", "linewidth": 2.2 if base else 1.2,
            "color": "black" if base else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, steps=300, global_batch=16, window=20)
    parser.add_argument("--sgd-lr", type=float, default=0.5, help="momentum SGD's learning rate")
    parser.add_argument("--sgd-set", action="append", default=["train.weight_decay=0", "train.momentum=0.9"],
                        help="extra config overrides of the SGD runs")
    parser.add_argument("--only", nargs="+", help="names of the runs to do (default: all; baselines always)")
    parser.add_argument("--tag", default="compression", help="name of the output files in bench/out")
    args = parser.parse_args()

    from threefold.launch.world import World

    base = base_overrides(args)
    per_optimizer = {"adamw": ["train.optimizer=adamw", f"train.lr={args.lr}"],
                     "sgd": ["train.optimizer=sgd", f"train.lr={args.sgd_lr}", *args.sgd_set]}
    todo = {k: v for k, v in runs(args.steps).items() if not args.only or k in args.only}
    needed = {BASELINES[opt] for opt, _ in todo.values()}
    todo = {k: v for k, v in runs(args.steps).items() if k in todo or k in needed}
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    with World(args.nproc, timeout_s=3600) as world:
        for name, (optimizer, overrides) in todo.items():
            results[name] = world.run(train_one, base + per_optimizer[optimizer] + overrides, str(OUT / "runs"))[0]
            results[name]["optimizer"] = optimizer
            done(name, results[name], args.window)

    dense_bytes = results[BASELINES[next(iter(todo.values()))[0]]]["bytes"]["dp"][-1]
    print(f"\n{args.model}, {args.nproc} processes, {args.steps} steps, global batch {args.global_batch} x "
          f"{args.seq_len} tokens, stdlib corpus; AdamW lr {args.lr}, momentum SGD lr {args.sgd_lr} "
          f"({' '.join(args.sgd_set)}); final loss = mean of the last {args.window} steps\n")
    print(f"{'method':32} {'optimizer':>9} {'bytes/step':>11} {'vs dense':>9} {'final loss':>11} {'vs baseline':>12}")
    table = []
    for name, res in results.items():
        sent = res["bytes"]["dp"][-1]
        loss = final(res["losses"], args.window)
        reference = final(results[BASELINES[res["optimizer"]]]["losses"], args.window)
        row = {"method": name, "optimizer": res["optimizer"], "bytes_per_step": sent,
               "compression": dense_bytes / sent if sent else float("inf"), "final_loss": loss,
               "loss_change_pct": 100 * (loss - reference) / reference}
        table.append(row)
        print(f"{name:32} {res['optimizer']:>9} {sent:>11,} {row['compression']:>8.1f}x {loss:>11.4f} "
              f"{row['loss_change_pct']:>+11.2f}%")
    (OUT / f"{args.tag}.json").write_text(json.dumps({"args": vars(args), "table": table,
                                                      "losses": {k: v["losses"] for k, v in results.items()}}))
    optimizer = {"AdamW: fp16, bf16, PowerSGD, 1-bit Adam": "adamw", "momentum SGD: DGC, 1-bit sign": "sgd"}
    plot({title: {k: v for k, v in results.items() if v["optimizer"] == opt} for title, opt in optimizer.items()},
         OUT / f"{args.tag}.png", style,
         "gradient compression: loss curves against the uncompressed run (dashed: mechanism switched off)")
    print(f"\ncurves: {OUT / (args.tag + '.png')}")


if __name__ == "__main__":
    main()
