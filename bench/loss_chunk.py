"""The loss head whole against in pieces (`model.loss_chunk`), on CPU: bytes kept for backward,
allocation peak of a forward + backward, and time, side by side in one process.

    PYTHONPATH=src python bench/loss_chunk.py [--batch 4] [--seq-len 256] [--vocab 8192] [--chunk 256] [--rounds 5]

Both sides are the same `small` decoder (4 blocks, hidden 256) with the given vocabulary, fp32,
one forward + backward of a (batch, seq) micro-batch per measure:
* **whole** - `model.loss_chunk=0`: the head's logits of the whole micro-batch, then
  F.cross_entropy (what PyTorch code usually writes);
* **pieces** - `model.loss_chunk=CHUNK`: checkpointed pieces of CHUNK tokens (models/loss.py).

Bytes kept for backward: observe/memory.py `SavedTensorMeter` (what the planner models). Peak:
torch.profiler's CPU memory events (allocations minus frees, in order), measured in a separate
pass from the timed rounds, so no instrumentation is inside a timed region. Rounds alternate.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from threefold.config import load_config
from threefold.models.decoder import build_model
from threefold.observe.memory import SavedTensorMeter


def allocation_peak(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(None, ["model.preset=small", f"model.vocab={args.vocab}"]).model
    model = build_model(cfg, 0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    sides = {"whole": 0, "pieces": args.chunk}

    def step(chunk, meter=None):
        model.cfg = dataclasses.replace(cfg, loss_chunk=chunk)
        model.zero_grad(set_to_none=True)
        if meter is None:
            loss = model(tokens, tokens)
        else:
            with meter.measure():
                loss = model(tokens, tokens)
        loss.backward()
        return loss.item()

    print(f"small decoder, vocab {args.vocab}, batch {args.batch} x {args.seq_len}, chunk {args.chunk}; "
          f"load {os.getloadavg()[0]:.2f}")
    figures = {}
    for name, chunk in sides.items():
        meter = SavedTensorMeter(exclude=list(model.parameters()))
        loss = step(chunk, meter)
        figures[name] = {"loss": loss, "saved": meter.peak, "peak": allocation_peak(lambda: step(chunk))}
    times = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, chunk in sides.items():
            start = time.perf_counter()
            step(chunk)
            times[name].append(time.perf_counter() - start)
    for name in sides:
        f = figures[name]
        print(f"{name:7s} loss {f['loss']:.6f}  kept for backward {f['saved'] / 2**20:8.2f} MiB  "
              f"allocation peak {f['peak'] / 2**20:8.2f} MiB  step {statistics.median(times[name]) * 1e3:8.1f} ms")
    w, p = figures["whole"], figures["pieces"]
    print(f"pieces / whole: kept {p['saved'] / w['saved']:.3f}x, peak {p['peak'] / w['peak']:.3f}x, "
          f"time {statistics.median(times['pieces']) / statistics.median(times['whole']):.3f}x, "
          f"loss rel diff {abs(p['loss'] - w['loss']) / abs(w['loss']):.1e}")


if __name__ == "__main__":
    main()
