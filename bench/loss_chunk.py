"""The loss head three ways, on CPU: bytes kept for backward, allocation peak of a forward +
backward, and time, side by side in one process; with --bytes, the HBM bytes per logit the
cross-entropy's kernels would move on a GPU, threefold's against torch's.

    PYTHONPATH=src python bench/loss_chunk.py [--batch 4] [--seq-len 256] [--vocab 8192] [--chunk 256]
                                              [--rounds 3] [--dtype bf16] [--quick]
    PYTHONPATH=src:. python bench/loss_chunk.py --bytes [--compiled]

--bytes: one forward + backward of the loss alone on 256 tokens x a vocabulary of 4096 (4072 real
columns and 24 of padding, or all 4096), 1 target in 9 ignored, bf16 and fp32 logits, for
models/cross_entropy.py, `F.cross_entropy(logits[:, :valid].float())` and `F.cross_entropy` on the
logits' own dtype. Eager: every aten operation recorded and priced by what its CUDA kernel moves
(tests/unit/test_loss_bytes.py `Traffic`). --compiled adds the compiled forward and backward
(fullgraph), priced by inductor's own count of its fused kernels' reads and writes
(num_bytes_accessed), for the padded vocabulary.

--quick measures batch 1 x 128 with pieces of 32 tokens (the same four pieces per micro-batch),
for CPUs without bf16 matrix units: there bf16 matmuls are emulated (on an AVX2 CPU one step of
the default 4 x 256 takes about 13 s, 90% of it in aten::mm; 1 x 128 takes under 2 s). Sizes given
explicitly win over --quick; without it the sizes are the defaults above.

All sides are the same `small` decoder (4 blocks, hidden 256) with the given vocabulary, its
parameters in --dtype, one forward + backward of a (batch, seq) micro-batch per measure:
* **F.cross_entropy** - the head's logits of the whole micro-batch, then
  `F.cross_entropy(logits.float())` (what PyTorch code usually writes; threefold's loss before);
* **default** - `model.loss_chunk=0`: the same logits, then models/cross_entropy.py (the logits
  kept in their dtype, fp32 one chunk of tokens at a time, no extra flops);
* **pieces** - `model.loss_chunk=CHUNK`: checkpointed pieces of CHUNK tokens (models/loss.py;
  one extra head forward).

Bytes kept for backward: observe/memory.py `SavedTensorMeter` (what the planner models). Peak:
torch.profiler's CPU memory events (allocations minus frees, in order), measured in a separate
pass from the timed rounds, so no instrumentation is inside a timed region. Rounds alternate (the
order of the sides reversed every other round); times are the median with quartiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

import torch.nn.functional as F

from threefold.config import load_config
from threefold.models.decoder import build_model
from threefold.models.loss import TokenCrossEntropy
from threefold.observe.memory import SavedTensorMeter, allocation_peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1 x 128, pieces of 32 (bf16 on a CPU without bf16 units)")
    ap.add_argument("--bytes", action="store_true", help="HBM bytes per logit of the loss's kernels, against torch's")
    ap.add_argument("--compiled", action="store_true", help="with --bytes: the compiled loss too (inductor's count)")
    args = ap.parse_args()
    if args.bytes:
        bytes_per_logit(args.compiled)
        return
    sizes = {"batch": 1, "seq_len": 128, "chunk": 32} if args.quick else {"batch": 4, "seq_len": 256, "chunk": 256}
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cfg = load_config(None, ["model.preset=small", f"model.vocab={args.vocab}"]).model
    model = build_model(cfg, 0).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    sides = {"F.cross_entropy": (0, FloatCrossEntropy()), "default": (0, TokenCrossEntropy(cfg.vocab)),
             "pieces": (args.chunk, TokenCrossEntropy(cfg.vocab))}

    def step(side, meter=None):
        chunk, model.loss = sides[side]
        model.cfg = dataclasses.replace(cfg, loss_chunk=chunk)
        model.zero_grad(set_to_none=True)
        if meter is None:
            loss = model(tokens, tokens)
        else:
            with meter.measure():
                loss = model(tokens, tokens)
        loss.backward()
        return loss.item()

    print(f"small decoder, {args.dtype}, vocab {args.vocab}, batch {args.batch} x {args.seq_len}, chunk {args.chunk}; "
          f"load {os.getloadavg()[0]:.2f}")
    figures = {}
    for name in sides:
        meter = SavedTensorMeter(exclude=list(model.parameters()))
        loss = step(name, meter)
        figures[name] = {"loss": loss, "saved": meter.peak, "peak": allocation_peak(lambda: step(name))}
    times = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    for name in sides:
        f = figures[name]
        q1, med, q3 = quartiles(times[name])
        print(f"{name:15s} loss {f['loss']:.6f}  kept for backward {f['saved'] / 2**20:8.2f} MiB  "
              f"allocation peak {f['peak'] / 2**20:8.2f} MiB  "
              f"step {med * 1e3:8.1f} ms [{q1 * 1e3:.1f}, {q3 * 1e3:.1f}]")
    w = figures["F.cross_entropy"]
    for name in ("default", "pieces"):
        p = figures[name]
        print(f"{name} / F.cross_entropy: kept {p['saved'] / w['saved']:.3f}x, peak {p['peak'] / w['peak']:.3f}x, "
              f"time {statistics.median(times[name]) / statistics.median(times['F.cross_entropy']):.3f}x, "
              f"loss rel diff {abs(p['loss'] - w['loss']) / abs(w['loss']):.1e}")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


def bytes_per_logit(compiled: bool) -> None:
    from tests.unit.test_loss_bytes import compiled_bytes, eager_bytes, ours, torch_loss

    n, v = 256, 4096
    sides = {"threefold": ours, "F.cross_entropy(.float())": lambda x, t, k: torch_loss(x, t, k, True),
             "F.cross_entropy": lambda x, t, k: torch_loss(x, t, k, False)}
    print(f"HBM bytes per logit, forward + backward, {n} tokens x vocabulary {v}; load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':9s} {'logits':8s} {'vocabulary':10s} " + " ".join(f"{name:>26s}" for name in sides))
    for mode, count, valids in (("eager", eager_bytes, (v, v - 24)), ("compiled", compiled_bytes, (v - 24,))):
        if mode == "compiled" and not compiled:
            continue
        for dtype in (torch.bfloat16, torch.float32):
            for valid in valids:
                figures = []
                for fn in sides.values():
                    got = count(fn, dtype, valid, n, v)
                    figures.append(got[0] if isinstance(got, tuple) else got)
                print(f"{mode:9s} {str(dtype)[6:]:8s} {'padded' if valid < v else 'whole':10s} "
                      + " ".join(f"{f:26.2f}" for f in figures))
    print(f"load {os.getloadavg()[0]:.2f} at the end")


def quartiles(x: list[float]) -> tuple[float, float, float]:
    return tuple(statistics.quantiles(x, n=4, method="inclusive")) if len(x) > 1 else (x[0],) * 3


class FloatCrossEntropy(torch.nn.Module):
    """`F.cross_entropy` on an fp32 copy of all logits (summed, as threefold's loss)."""

    def forward(self, logits_bsv, targets_bs):
        return F.cross_entropy(logits_bsv.flatten(0, 1).float(), targets_bs.flatten(), reduction="sum")


if __name__ == "__main__":
    main()
