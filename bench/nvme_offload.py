"""Whole training steps with parallel.offload=nvme against offload=optimizer (CPU) and none, the overlap.

    python bench/nvme_offload.py --dir /scratch [--layers 8 --hidden 512] [--zero 3] [--rounds 7]

One process (a gloo world of 1), the reference decoder, AdamW, one Trainer per mode built side by
side: per round, in turn, one whole step (forward, backward, norm and clipping, optimizer step) of
each mode - alternating, so drift in the machine's load hits all three alike - after one warm-up
round. Prints each mode's step time (median and quartiles over the rounds); for nvme the overlap,
the time the step waited on scratch reads / the total time of those reads (0: every read hidden
behind compute, 1: none; the states' reads in the optimizer step and, under ZeRO-3, the parameter
shards' reads before their gathers and the gradients' reads as they accumulate and in the step), and the scratch bandwidth the step achieved (bytes read and
written / the time in reads and writes) against `dd` on the same directory (a file of the states'
size, 4 MiB blocks, oflag=direct then iflag=direct; without O_DIRECT where the filesystem refuses
it, which the table says). The nvme Trainer fixes malloc's mmap threshold for the whole process
(parallel/nvme.py `return_freed_memory`), so all three modes run with it; `--keep-freed` turns it off
(parallel.offload_return_memory=false) to measure the other side.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def dd_bandwidth(directory: Path, nbytes: int) -> tuple[float, float, bool]:
    """(write, read) bytes/s of dd on `directory`, and whether O_DIRECT was accepted."""
    path = directory / f"dd-{os.getpid()}.tmp"
    count = max(1, nbytes // 2**22)

    def run(args: list[str]) -> float:
        out = subprocess.run(["dd", *args, "bs=4M", f"count={count}"], capture_output=True, text=True).stderr
        m = re.search(r"copied, ([\d.]+) s", out)
        return count * 2**22 / float(m.group(1)) if m else float("nan")

    try:
        direct = True
        write = run(["if=/dev/zero", f"of={path}", "oflag=direct"])
        if write != write:  # the filesystem refuses O_DIRECT
            direct = False
            write = run(["if=/dev/zero", f"of={path}", "conv=fsync"])
        read = run([f"if={path}", "of=/dev/null", "iflag=direct"] if direct else [f"if={path}", "of=/dev/null"])
        return write, read, direct
    finally:
        path.unlink(missing_ok=True)


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"median {xs[0] * 1e3:.0f} ms"
    q = statistics.quantiles(xs, n=4)
    return f"median {statistics.median(xs) * 1e3:.0f} ms (q1 {q[0] * 1e3:.0f}, q3 {q[2] * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory (parallel.offload_dir)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--block-mb", type=float, default=16.0)
    ap.add_argument("--keep-freed", action="store_true",
                    help="parallel.offload_return_memory=false: malloc keeps its own thresholds (a setting of the "
                         "process, so one run measures one of the two)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    dist.init_process_group("gloo")
    model = ["model.preset=tiny", f"model.layers={args.layers}", f"model.hidden={args.hidden}", "model.heads=8",
             "model.kv_heads=8", f"model.ffn_hidden={4 * args.hidden}", "model.vocab=1024",
             f"train.steps={args.rounds + 2}", f"train.global_batch={args.batch}", f"train.seq_len={args.seq}",
             f"parallel.zero={args.zero}", "train.grad_clip=1.0", "run.progress=false", "run.plot=false",
             "checkpoint.save_every=0"]
    modes = {"none": [], "cpu": ["parallel.offload=optimizer"],
             "nvme": ["parallel.offload=nvme", f"parallel.offload_dir={args.dir}",
                      f"parallel.offload_prefetch={args.prefetch}", f"parallel.offload_block_mb={args.block_mb}",
                      f"parallel.offload_return_memory={'false' if args.keep_freed else 'true'}"]}
    out = Path(tempfile.mkdtemp(prefix="nvme-bench-"))
    trainers = {mode: Trainer(load_config(None, [f"run.out={out / mode}", *model, *extra]))
                for mode, extra in modes.items()}
    times: dict[str, list[float]] = {m: [] for m in modes}
    overlap, bandwidth = [], []
    nvme = trainers["nvme"].optimizer
    io = [nvme.stats] + [store.stats for store in (nvme.home, nvme.grads) if store is not None]
    for round_ in range(args.rounds + 1):  # the first round warms up and is dropped
        for mode, trainer in trainers.items():
            for s in io:
                s.reset()
            start = time.perf_counter()
            trainer.train_one_step()
            if round_:
                times[mode].append(time.perf_counter() - start)
            if mode == "nvme" and round_:
                wait, read = sum(s.wait_s for s in io), sum(s.read_s for s in io)
                overlap.append(wait / read if read else 0.0)
                moved = sum(s.read_bytes + s.write_bytes for s in io)
                bandwidth.append(moved / sum(s.read_s + s.write_s for s in io))
    params = sum(p.numel() for p in trainers["none"].parallel.module.parameters())
    shards = nvme.home.nbytes if nvme.home is not None else 0
    grads = nvme.grads.nbytes if nvme.grads is not None else 0
    print(f"{params / 1e6:.1f}M parameters, ZeRO-{args.zero}, AdamW, batch {args.batch} x {args.seq} tokens; nvme: "
          f"states {nvme.nbytes / 2**20:.0f} MiB in {len(nvme.units)} units (O_DIRECT {'on' if nvme.direct else 'off'}), "
          f"parameter shards {shards / 2**20:.0f} MiB, gradients {grads / 2**20:.0f} MiB, prefetch {args.prefetch}; "
          f"{args.rounds} rounds; malloc's mmap threshold {'its own' if args.keep_freed else 'fixed (return_memory)'}")
    print("| offload | whole step |")
    print("| --- | --- |")
    for mode in modes:
        print(f"| {mode} | {quartiles(times[mode])} |")
    print(f"overlap: the step waited on scratch reads for {statistics.median(overlap):.0%} of their time (median)")
    write, read, direct = dd_bandwidth(args.dir, nvme.nbytes)
    print(f"scratch: {statistics.median(bandwidth) / 1e9:.2f} GB/s achieved (reads and writes); dd on {args.dir}: "
          f"write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s "
          f"({'O_DIRECT' if direct else 'buffered: the filesystem refuses O_DIRECT'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
