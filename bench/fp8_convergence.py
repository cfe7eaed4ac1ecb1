"""FP8 training against bf16: final losses under several layouts, seeds alternating (docs/fp8.md).

For each model and layout, trains the same job in bf16 and in fp8 (precision.compute=fp8 with
precision.fp8_linears=all and fp8_skip_first_last=false: on a CPU the auto rule converts nothing, so
every block linear is forced to fp8, emulated by torchao's fp32 matmul of the dequantised operands),
once per seed, bf16 and fp8 in turn. Prints per (model, layout) the final losses (mean of the last
`--window` steps) of every seed and the ratio fp8 / bf16 of their means; writes bench/out/fp8_convergence.json.

    python bench/fp8_convergence.py [--steps 200] [--models tiny,small] [--seeds 0,1,2] [--recipe tensorwise]

A model with experts replaces the dense one under ep2 (tiny -> tiny-moe, small -> small-moe).
"""

from __future__ import annotations

import argparse
import json
import time

from curves import OUT, final, train_one

LAYOUTS = {  # name -> (processes, overrides)
    "single": (1, []),  # (dp, tp, pp) = (1, 1, 1)
    "dp2 zero3": (2, ["parallel.dp=2", "parallel.zero=3"]),
    "tp2+sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "train.microbatches=2"]),
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
}
FP8 = ["precision.compute=fp8", "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--json", default="fp8_convergence.json", help="file name under bench/out")
    args = parser.parse_args()

    from threefold.launch.world import World

    OUT.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    layouts = args.layouts.split(",")
    table, worlds = [], {}
    try:
        for model in args.models.split(","):
            for layout in layouts:
                nproc, overrides = LAYOUTS[layout]
                preset = f"{model}-moe" if layout == "ep2" else model
                world = worlds.setdefault(nproc, World(nproc, timeout_s=7200))
                finals = {"bf16": [], "fp8": []}
                start = time.perf_counter()
                for seed in seeds:
                    for precision in ("bf16", "fp8"):  # alternating: each seed's pair back to back
                        settings = (["precision.compute=bf16"] if precision == "bf16"
                                    else FP8 + [f"precision.fp8_recipe={args.recipe}"])
                        job = [f"model.preset={preset}", f"train.steps={args.steps}",
                               f"train.global_batch={args.global_batch}", f"train.seq_len={args.seq_len}",
                               f"train.lr={args.lr}", f"train.warmup_steps={args.steps // 20}", "data.source=stdlib",
                               f"train.seed={seed}", *overrides, *settings]
                        out = str(OUT / "runs" / f"fp8-{preset}-{layout.replace(' ', '').replace(',', '')}-{precision}")
                        res = world.run(train_one, job, out)[0]
                        finals[precision].append(final(res["losses"], args.window))
                bf16 = sum(finals["bf16"]) / len(seeds)
                fp8 = sum(finals["fp8"]) / len(seeds)
                row = {"model": preset, "layout": layout, "bf16": finals["bf16"], "fp8": finals["fp8"],
                       "ratio": fp8 / bf16, "seconds": time.perf_counter() - start}
                table.append(row)
                print(f"{preset:10} {layout:10} bf16 {' '.join(f'{x:.4f}' for x in finals['bf16'])}  "
                      f"fp8 {' '.join(f'{x:.4f}' for x in finals['fp8'])}  fp8/bf16 {row['ratio']:.4f} "
                      f"({100 * (row['ratio'] - 1):+.2f}%)  {row['seconds']:.0f} s", flush=True)
    finally:
        for world in worlds.values():
            world.close()
    (OUT / args.json).write_text(json.dumps({"args": vars(args), "table": table}, indent=1))
    worst = max(abs(r["ratio"] - 1) for r in table)
    print(f"\n{args.steps} steps, global batch {args.global_batch} x {args.seq_len}, seeds {args.seeds}, recipe "
          f"{args.recipe}: worst |fp8/bf16 - 1| = {100 * worst:.2f}% of the final loss")


if __name__ == "__main__":
    main()
