"""Local SGD and DiLoCo: convergence against the synchronous (dense) run, and the bytes they save.

Trains the same model on the stdlib corpus, same seed, data order and learning-rate schedule, on
N processes (each a replica), three ways:

    dense        gradients summed over dp every step (the baseline)
    diloco H=8   inner AdamW alone for 8 steps, then an outer Nesterov step on the averaged delta
    local H=4    AdamW alone for 4 steps, then the replicas take their average

Prints one row per run: the model bytes this rank sent over dp in the whole run (counted by Comm),
the ratio to the dense run, the final training loss (mean of the last `--window` steps; 600 steps
is a whole number of periods of both, so the last one ends on a meeting) and its change against
the dense run. Writes the curves to bench/out/local_sgd.png and the figures to
bench/out/local_sgd.json. Each run's results are also kept in bench/out/local_sgd-<run>.json, so
the runs can be done one per invocation (`--only`) and reported together (`--report`).

    python bench/local_sgd.py [--steps 600] [--nproc 4] [--model tiny] [--outer 0.7:0.9 ...] [--sync-warmup W]
                              [--only dense diloco local ...] [--report]
"""

from __future__ import annotations

import argparse
import json
import os

from curves import OUT, add_run_args, base_overrides, done, final, plot, train_one

TARGET_PCT = {"diloco": 3.0, "local": 5.0}


def runs(args) -> dict[str, tuple[str, list[str]]]:
    """name -> (label, overrides). DiLoCo once per --outer LR:MOMENTUM (default 0.7:0.9, the paper's)."""
    warm = [f"train.sync_warmup_steps={args.sync_warmup}"] if args.sync_warmup else []
    after = f", {args.sync_warmup} synchronous steps first" if args.sync_warmup else ""
    out = {"dense": ("dense (every step)", [])}
    for pair in args.outer:
        lr, momentum = pair.split(":")
        name = "diloco" if pair == "0.7:0.9" and not warm else f"diloco-{lr}-{momentum}-w{args.sync_warmup}"
        out[name] = (f"DiLoCo H=8 outer {lr}/{momentum}{after}",
                     ["train.sync_every=8", "train.outer_optimizer=nesterov", f"train.outer_lr={lr}",
                      f"train.outer_momentum={momentum}", *warm])
    name = "local" if not warm else f"local-w{args.sync_warmup}"
    out[name] = (f"local SGD H=4{after}", ["train.sync_every=4", *warm])
    return out


def style(name: str, res: dict) -> dict:
    dense = name == "dense"
    return {"label": res["label"], "linewidth": 2.2 if dense else 1.3, "color": "black" if dense else None}


def report(args, base: list[str]) -> None:
    results = {}
    for name in runs(args):
        path = OUT / f"local_sgd-{name}.json"
        if path.exists():
            stored = json.loads(path.read_text())
            if stored["base"] != base:
                raise SystemExit(f"{path} was trained with other settings; run it again")
            results[name] = stored
    if "dense" not in results:
        raise SystemExit("no dense run to compare with; run --only dense first")
    title = (f"{args.model}, {args.nproc} processes, {args.steps} steps, global batch {args.global_batch} x "
             f"{args.seq_len}, stdlib corpus, AdamW lr {args.lr}")
    print(f"\n{title}; final loss = mean of the last {args.window} steps\n")
    print(f"{'run':46} {'dp bytes (rank 0)':>18} {'vs dense':>9} {'final loss':>11} {'vs dense':>9} "
          f"{'target':>8} {'seconds':>8}")
    dense_bytes, dense_loss = sum(results["dense"]["bytes"]["dp"]), final(results["dense"]["losses"], args.window)
    table = []
    for name, res in results.items():
        sent, loss = sum(res["bytes"]["dp"]), final(res["losses"], args.window)
        kind = name.split("-")[0]
        row = {"run": name, "label": res["label"], "overrides": res["overrides"], "dp_bytes": sent,
               "bytes_ratio": dense_bytes / sent, "final_loss": loss, "loss_change_pct": 100 * (loss - dense_loss) / dense_loss,
               "target_pct": TARGET_PCT.get(kind), "seconds": res["seconds"], "load": res["load"]}
        row["within_target"] = None if kind == "dense" else abs(row["loss_change_pct"]) <= TARGET_PCT[kind]
        table.append(row)
        target = f"{TARGET_PCT[kind]:.0f}%" if kind in TARGET_PCT else ""
        print(f"{res['label']:46} {sent:>18,} {row['bytes_ratio']:>8.2f}x {loss:>11.4f} "
              f"{row['loss_change_pct']:>+8.2f}% {target:>8} {res['seconds']:>8.0f}")
    print("load average (1 min) at the end of each run: " + ", ".join(f"{r['run']} {r['load']:.2f}" for r in table))
    (OUT / f"{args.tag}.json").write_text(json.dumps({"args": vars(args), "base": base, "table": table,
                                                    "losses": {k: v["losses"] for k, v in results.items()}}))
    with open(OUT / f"{args.tag}.csv", "w") as f:
        f.write("run,dp_bytes,bytes_ratio,final_loss,loss_change_pct,target_pct,within_target,seconds,load\n")
        for r in table:
            f.write(f"{r['run']},{r['dp_bytes']},{r['bytes_ratio']:.4f},{r['final_loss']:.6f},"
                    f"{r['loss_change_pct']:.4f},{r['target_pct'] or ''},{r['within_target']},{r['seconds']:.1f},"
                    f"{r['load']:.2f}\n")
    plot({title: results}, OUT / f"{args.tag}.png", style)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, steps=600, global_batch=32, window=40)
    parser.add_argument("--outer", nargs="+", default=["0.7:0.9"], metavar="LR:MOMENTUM",
                        help="DiLoCo's outer learning rate and Nesterov momentum; one run per pair")
    parser.add_argument("--sync-warmup", type=int, default=0, help="synchronous steps before the periodic runs")
    parser.add_argument("--only", nargs="+", help="names of the runs to train now (default: all; see runs())")
    parser.add_argument("--tag", default="local_sgd", help="name of the report files in bench/out")
    parser.add_argument("--report", action="store_true", help="only report the stored runs")
    args = parser.parse_args()

    base = base_overrides(args, f"train.lr={args.lr}")
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.report:
        from threefold.launch.world import World

        with World(args.nproc, timeout_s=3600) as world:
            for name, (label, overrides) in runs(args).items():
                if args.only and name not in args.only:
                    continue
                res = world.run(train_one, base + overrides, str(OUT / "runs" / f"local_sgd-{name}"))[0]
                res.update(base=base, label=label, overrides=overrides, load=os.getloadavg()[0])
                (OUT / f"local_sgd-{name}.json").write_text(json.dumps(res))
                done(label, res, args.window)
    report(args, base)


if __name__ == "__main__":
    main()
