"""Quantized ZeRO-3 (after ZeRO++): bytes over dp and the final loss against the 32- and 16-bit wires.

Trains the same model on the stdlib corpus with ZeRO-3 on N processes, same seed and data:

    fp32 wire          fp32 compute; weights gathered and gradients reduce-scattered in fp32
    int8 / fp32        fp32 compute; parallel.zero_weight_comm=int8, parallel.zero_grad_comm=int8
    bf16 wire          bf16 compute (fp32 masters); weights gathered and gradients reduced in bf16
    int8 / bf16        bf16 compute; int8 weights and gradients
    int8 / bf16 + hpZ  as above on two "nodes" (LOCAL_WORLD_SIZE = N / 2) with parallel.zero_hpz=true

Prints one row per run: the model bytes this rank sent per step over dp (and dp_intra: hpZ's
backward gather, inside the node), counted by Comm, the ratio of the dp bytes to the fp32 and to
the bf16 wire, and the final loss (mean of the last `--window` steps) against the run of the same
compute precision with the unquantized wire. Writes bench/out/zero_quantized.{json,png}.

    python bench/zero_quantized.py [--steps 300] [--nproc 4] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import os

from curves import OUT, add_run_args, base_overrides, done, final, plot, train_one

INT8 = ["parallel.zero_weight_comm=int8", "parallel.zero_grad_comm=int8"]
BF16 = ["precision.compute=bf16", "precision.reduce_dtype=bf16"]
RUNS = {  # name -> (overrides, baseline, nodes the processes are split into)
    "fp32 wire": ([], "fp32 wire", 1),
    "int8 / fp32": (INT8, "fp32 wire", 1),
    "bf16 wire": (BF16, "bf16 wire", 1),
    "int8 / bf16": (BF16 + INT8, "bf16 wire", 1),
    "int8 / bf16 + hpZ": (BF16 + INT8 + ["parallel.zero_hpz=true"], "bf16 wire", 2),
}


def style(name: str, res: dict) -> dict:
    return {"linestyle": "--" if "int8" in name else "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, steps=300, global_batch=32, window=20)
    args = parser.parse_args()

    from threefold.launch.world import World

    base = base_overrides(args, f"train.lr={args.lr}", "parallel.zero=3")
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    with World(args.nproc, timeout_s=3600) as world:
        for name, (overrides, _, nodes) in RUNS.items():
            out = str(OUT / "runs" / f"zero_quantized-{name.replace(' ', '').replace('/', '-')}")
            results[name] = world.run(train_one, base + overrides, out, ("dp", "dp_intra"), args.nproc // nodes)[0]
            results[name]["load"] = os.getloadavg()[0]
            done(name, results[name], args.window)
    title = (f"ZeRO-3, {args.model}, {args.nproc} processes, {args.steps} steps, global batch {args.global_batch} x "
             f"{args.seq_len}, stdlib corpus, AdamW lr {args.lr}")
    print(f"\n{title}; bytes: rank 0, per step (the last); final loss = mean of the last {args.window} steps\n")
    print(f"{'run':18} {'dp bytes':>10} {'dp_intra':>9} {'vs fp32':>8} {'vs bf16':>8} {'final loss':>11} "
          f"{'vs baseline':>12} {'seconds':>8}")
    fp32, bf16 = results["fp32 wire"]["bytes"]["dp"][-1], results["bf16 wire"]["bytes"]["dp"][-1]
    table = []
    for name, res in results.items():
        baseline = RUNS[name][1]
        sent, loss = res["bytes"]["dp"][-1], final(res["losses"], args.window)
        ref = final(results[baseline]["losses"], args.window)
        row = {"run": name, "overrides": RUNS[name][0], "baseline": baseline, "dp_bytes": sent,
               "dp_intra_bytes": res["bytes"]["dp_intra"][-1], "vs_fp32": fp32 / sent, "vs_bf16": bf16 / sent,
               "final_loss": loss, "loss_change_pct": 100 * (loss - ref) / ref, "seconds": res["seconds"],
               "load": res["load"]}
        table.append(row)
        print(f"{name:18} {sent:>10,} {row['dp_intra_bytes']:>9,} {row['vs_fp32']:>7.2f}x {row['vs_bf16']:>7.2f}x "
              f"{loss:>11.4f} {row['loss_change_pct']:>+11.2f}% {res['seconds']:>8.0f}")
    print("load average (1 min) at the end of each run: " + ", ".join(f"{r['run']} {r['load']:.2f}" for r in table))
    (OUT / "zero_quantized.json").write_text(json.dumps({"args": vars(args), "table": table,
                                                         "losses": {k: v["losses"] for k, v in results.items()}}))
    plot({title: results}, OUT / "zero_quantized.png", style)


if __name__ == "__main__":
    main()
