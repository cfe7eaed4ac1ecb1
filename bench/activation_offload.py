"""Step time of activation offload (`remat.offload=cpu`) next to no offload, and the copies' time.

One process, forward + backward of the reference decoder, the two models in alternating rounds
(so a busy machine slows both alike), each with and without selective recomputation. Per case:
quartiles of the step time, its ratio to the same policy without offload (medians), the bytes
the copies moved per step, the time spent in them (host clock on the CPU, where the copies run
in line with the step; CUDA events on the side stream on a GPU) and that time as a share of the
step. `hidden` is the part of the copy time the step did not pay for:
1 - (step with offload - step without) / copy time - near 0 on the CPU (nothing runs beside the
copies there), near 1 on a GPU when the side stream's copies overlap the compute stream's work.
The CUDA path (pinned buffers, side stream, events) is written but not run on a GPU here.

    python bench/activation_offload.py --model small --batch 4 --seq-len 256 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from threefold.config import RematConfig, load_config
from threefold.models.decoder import build_model
from threefold.observe.memory import SavedTensorMeter
from threefold.parallel.remat import apply_offload, apply_remat


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = load_config(None, [f"model.preset={args.model}"]).model
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)

    cases = []
    for policy in ("none", "selective"):
        for offload in ("none", "cpu"):
            model = build_model(cfg, 0).to(device)
            remat = RematConfig(policy=policy, offload=offload)
            apply_remat(model, remat)
            cases.append((f"{policy}, offload={offload}", model, apply_offload(model, remat, device),
                          SavedTensorMeter(exclude=list(model.parameters()))))

    def step(model, offload, meter) -> float:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        meter.reset()
        with meter.measure():
            loss = model(tokens, tokens)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times = [[] for _ in cases]
    copies = [[] for _ in cases]
    for r in range(args.rounds + 1):  # alternating rounds; the first warms up
        for k, (_, model, offload, meter) in enumerate(cases):
            before = offload.timings().to_host_s + offload.times.to_device_s if offload else 0.0
            seconds = step(model, offload, meter)
            after = offload.timings().to_host_s + offload.times.to_device_s if offload else 0.0
            if r:
                times[k].append(seconds)
                copies[k].append(after - before)
    print(f"model {args.model}, batch {args.batch}, seq {args.seq_len}, {args.device}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"{'case':28} {'q1 s':>7} {'median':>7} {'q3 s':>7} {'vs off':>7} {'device bytes':>13} {'moved/step':>11} "
          f"{'copy s':>7} {'copy/step':>9} {'hidden':>7}")
    for k, (name, _, offload, meter) in enumerate(cases):
        q1, med, q3 = quartiles(times[k])
        base = statistics.median(times[k - 1]) if offload else med
        copy = statistics.median(copies[k]) if offload else 0.0
        moved = (offload.times.bytes_to_host // (args.rounds + 1)) if offload else 0
        hidden = 1 - (med - base) / copy if copy else float("nan")
        print(f"{name:28} {q1:7.4f} {med:7.4f} {q3:7.4f} {med / base:6.2f}x {meter.current:13,d} {moved:11,d} "
              f"{copy:7.4f} {copy / med:8.1%} {hidden:7.2f}")
    print("vs off: median step over the same policy without offload; hidden: 1 - extra step time / copy time")


if __name__ == "__main__":
    main()
