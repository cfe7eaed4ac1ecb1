"""MXFP8 training against bf16 and tensorwise fp8: final losses over seeds (docs/fp8.md).

Trains the same job three ways - bf16, tensorwise fp8 and mxfp8 (precision.fp8_linears=all,
fp8_skip_first_last=false: on a CPU the auto rule converts nothing, so every block linear is forced
to the format, emulated by torchao's matmul of the dequantised operands) - once per seed, the three
precisions of a seed back to back in one process (`--jobs N`: N seeds side by side). Prints each precision's final losses (mean of the last `--window`
steps), their mean and standard deviation over seeds, and the ratios of the means to bf16's; writes
bench/out/mxfp8_convergence.json and, with --plot, a loss-curve figure (mean over seeds).

    nice python bench/mxfp8_convergence.py [--steps 200] [--seeds 0,1,2] [--jobs 1] [--plot docs/mxfp8-loss.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from curves import OUT, final, train_one

PRECISIONS = {
    "bf16": ["precision.compute=bf16"],
    "fp8": ["precision.compute=fp8", "precision.fp8_recipe=tensorwise"],
    "mxfp8": ["precision.compute=mxfp8"],
}
ALL_LINEARS = ["precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]


def plot(curves: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=100)
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over seeds)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    """The three precisions of one seed, back to back in one process: {precision: final, losses, seconds}."""
    from threefold.launch.world import World

    out: dict[str, dict] = {}
    world = World(1, timeout_s=7200)
    try:
        for name, settings in PRECISIONS.items():
            job = [f"model.preset={args.model}", f"train.steps={args.steps}", f"train.global_batch={args.global_batch}",
                   f"train.seq_len={args.seq_len}", f"train.lr={args.lr}", f"train.warmup_steps={args.steps // 20}",
                   "data.source=stdlib", f"train.seed={seed}", *settings, *(ALL_LINEARS if name != "bf16" else [])]
            start = time.perf_counter()
            res = world.run(train_one, job, str(OUT / "runs" / f"mxfp8-{args.model}-{name}-seed{seed}"))[0]
            out[name] = {"final": final(res["losses"], args.window), "losses": res["losses"],
                         "seconds": time.perf_counter() - start}
            print(f"seed {seed} {name:6} final {out[name]['final']:.4f}  {out[name]['seconds']:.0f} s", flush=True)
    finally:
        world.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="seeds trained side by side (one process each)")
    parser.add_argument("--plot", default="", help="write the loss curves (mean over seeds) to this PNG")
    parser.add_argument("--json", default="mxfp8_convergence.json", help="file name under bench/out")
    args = parser.parse_args()

    seeds = [int(s) for s in args.seeds.split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:  # a seed's three runs in one process, --jobs seeds side by side
        done = list(pool.map(lambda seed: one_seed(args, seed), seeds))
    finals = {p: [d[p]["final"] for d in done] for p in PRECISIONS}
    curves = {p: [d[p]["losses"] for d in done] for p in PRECISIONS}
    seconds = {p: sum(d[p]["seconds"] for d in done) for p in PRECISIONS}
    rows = {}
    for name in PRECISIONS:
        mean, std = statistics.mean(finals[name]), statistics.stdev(finals[name]) if len(seeds) > 1 else 0.0
        rows[name] = {"finals": finals[name], "mean": mean, "std": std, "seconds": seconds[name]}
    base = rows["bf16"]["mean"]
    print(f"{args.model}, {args.steps} steps, global batch {args.global_batch} x {args.seq_len}, lr {args.lr}, "
          f"seeds {args.seeds}; final loss = mean of the last {args.window} steps")
    for name, row in rows.items():
        row["ratio_to_bf16"] = row["mean"] / base
        print(f"{name:6} finals {' '.join(f'{x:.4f}' for x in row['finals'])}  mean {row['mean']:.4f}  "
              f"std {row['std']:.4f}  / bf16 {row['ratio_to_bf16']:.4f} ({100 * (row['ratio_to_bf16'] - 1):+.2f}%)  "
              f"{row['seconds']:.0f} s", flush=True)
    print(f"mxfp8 / fp8 (means): {rows['mxfp8']['mean'] / rows['fp8']['mean']:.4f}")
    (OUT / args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.plot:
        mean_curves = {name: [statistics.mean(step) for step in zip(*runs)] for name, runs in curves.items()}
        plot(mean_curves, args.plot, f"{args.model}, {args.steps} steps, seeds {args.seeds} (CPU emulation)")


if __name__ == "__main__":
    main()
