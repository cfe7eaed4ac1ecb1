"""FP8 against bf16, one linear's forward + backward by GEMM shape: the measured ratio beside the auto rule's.

For each (M, K, N) of a grid (the tokens of a micro-batch by a block's linear shapes), times
`F.linear` in bf16 and threefold's fp8 matmul (parallel/fp8.py `Fp8Kernel`: torchao's casts and
`torch._scaled_mm`) over forward and backward, and prints the measured bf16/fp8 time ratio next to the
planner's model of it (planner/compute.py `fp8_speedup`, the ratio `precision.fp8_linears=auto`
decides by). Writes the table as JSON (`--json`): the measured per-GPU table docs/fp8.md asks to
compare the model with. On a device without fp8 tensor cores the fp8 side is emulated (`--smoke`:
tiny shapes on the CPU, only to keep the script working).

    python bench/fp8_gemm.py [--recipe tensorwise] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

GRID = [(m, k, n) for m in (1024, 4096, 16384) for k, n in ((768, 768), (2048, 2048), (2048, 8192), (4096, 4096),
                                                              (4096, 14336), (8192, 8192))]
SMOKE_GRID = [(64, 32, 32), (128, 64, 128)]


def seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--json", default="")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    from threefold.parallel.fp8 import Fp8Kernel, Fp8Recipe, hardware_fp8
    from threefold.planner.compute import fp8_speedup
    from threefold.planner.hardware import fp8_gpu

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    gpu = fp8_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    kernel = Fp8Kernel(Fp8Recipe.named(args.recipe), emulate=not hardware_fp8(device))
    rows = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, recipe {args.recipe}, {'emulated' if kernel.emulate else 'torch._scaled_mm'}; "
          "forward + backward of one linear")
    print(f"{'M':>6} {'K':>6} {'N':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'measured':>9} {'model':>7}")
    for m, k, n in SMOKE_GRID if args.smoke else GRID:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        bf16 = seconds(lambda: F.linear(x, w).backward(g), device, args.repeats)
        fp8 = seconds(lambda: kernel(x, w, None).backward(g), device, args.repeats)
        model = fp8_speedup(m, k, n, gpu, args.recipe) if gpu is not None else 0.0
        rows.append({"m": m, "k": k, "n": n, "bf16_s": bf16, "fp8_s": fp8, "measured": bf16 / fp8, "model": model})
        print(f"{m:>6} {k:>6} {n:>6} {1e3 * bf16:>9.3f} {1e3 * fp8:>9.3f} {bf16 / fp8:>8.2f}x {model:>6.2f}x",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "recipe": args.recipe, "emulated": kernel.emulate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
