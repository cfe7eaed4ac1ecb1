"""Optimizer step time with parallel.offload=nvme against offload=optimizer and none, and the overlap.

    python bench/nvme_offload.py --dir /scratch --params 16e6 --rounds 5 [--prefetch 2] [--block-mb 64]

One process, the optimizer over this many fp32 parameters cut into 8 pieces (ZeRO-1's shards of
one rank look like this), AdamW: per round, in turn, one step of each mode (alternating, so drift
in the machine's load hits all three alike); prints each mode's step time quartiles over the
rounds, and for nvme the overlap: the time the step waited on reads / the reader's total read
time (0: every read was hidden behind the update of the previous unit; 1: none was), and the
scratch bandwidth achieved (bytes read and written / the reader's time in them) against what
`dd` achieves on the same directory (a file of the same size, 4 MiB blocks, O_DIRECT, written
then read).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from threefold.config import TrainConfig  # noqa: E402
from threefold.parallel.master import Piece, ShardedOptimizer  # noqa: E402
from threefold.parallel.nvme import NvmeOptimizer, ScratchSettings  # noqa: E402
from threefold.sharding import Placement  # noqa: E402


def pieces(n: int, count: int = 8) -> tuple[list[Piece], torch.Tensor]:
    param = torch.randn(n)
    grad = torch.randn(n) * 1e-3
    place = Placement.whole("w", (n,))
    bounds = [i * n // count for i in range(count + 1)]
    return [Piece("w", place.flat_shard(a, b), param[a:b], (lambda g=grad[a:b]: g), True, a)
            for a, b in zip(bounds, bounds[1:])], param


def dd_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of dd on `directory` (O_DIRECT where it is accepted)."""
    path = directory / f"dd-{os.getpid()}.tmp"
    count = max(1, nbytes // 2**22)

    def run(args: list[str]) -> float:
        out = subprocess.run(["dd", *args, "bs=4M", f"count={count}"], capture_output=True, text=True).stderr
        m = re.search(r"copied, ([\d.]+) s", out)
        return count * 2**22 / float(m.group(1)) if m else float("nan")

    try:
        write = run(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"])
        if write != write:
            write = run(["if=/dev/zero", f"of={path}", "conv=fsync"])
        read = run([f"if={path}", "of=/dev/null", "iflag=direct"])
        if read != read:
            read = run([f"if={path}", "of=/dev/null"])
        return write, read
    finally:
        path.unlink(missing_ok=True)


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0] * 1e3:.1f} ms"
    q = statistics.quantiles(xs, n=4)
    return f"q1 {q[0] * 1e3:.1f} / median {q[1] * 1e3:.1f} / q3 {q[2] * 1e3:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory (parallel.offload_dir)")
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--block-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    cfg = TrainConfig(lr=1e-4, weight_decay=0.1)
    optimizers = {"none": ShardedOptimizer(pieces(n)[0], cfg, offload=False),
                  "optimizer": ShardedOptimizer(pieces(n)[0], cfg, offload=True),
                  "nvme": NvmeOptimizer(pieces(n)[0], cfg, ScratchSettings(args.dir, args.prefetch, args.block_mb))}
    times: dict[str, list[float]] = {k: [] for k in optimizers}
    overlap, bandwidth = [], []
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for mode, opt in optimizers.items():
            if mode == "nvme":
                opt.stats.reset()
            start = time.perf_counter()
            opt.prepare_grads(1.0)
            opt.step()
            times[mode].append(time.perf_counter() - start)
            if mode == "nvme":
                s = opt.stats
                overlap.append(s.wait_s / s.read_s if s.read_s else 0.0)
                bandwidth.append((s.read_bytes + s.write_bytes) / (s.read_s + s.write_s))
    nvme = optimizers["nvme"]
    print(f"{n / 1e6:.0f}M parameters, AdamW, states {nvme.nbytes / 2**20:.0f} MiB per step read and written "
          f"({len(nvme.units)} units, prefetch {args.prefetch}, O_DIRECT {'on' if nvme.direct else 'off'}), "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}")
    for mode in optimizers:
        print(f"  offload={mode:<9} step {quartiles(times[mode][1:])}")
    print(f"  overlap: the step waited on reads for {statistics.median(overlap[1:]):.0%} of the read time (median)")
    write, read = dd_bandwidth(args.dir, nvme.nbytes)
    print(f"  scratch: {statistics.median(bandwidth[1:]) / 1e9:.2f} GB/s achieved (reads and writes); "
          f"dd on {args.dir}: write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s")
    nvme.close()


if __name__ == "__main__":
    main()
