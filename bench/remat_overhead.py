"""Time and memory of activation checkpointing: threefold's policies next to PyTorch's own wrapper.

One process, forward + backward of the reference decoder. For each policy: median step time,
its ratio to no checkpointing (target for `full`: <= 1.35x, i.e. one extra forward at most),
and the bytes autograd keeps for backward (saved-tensor hooks, parameters excluded). The
PyTorch-native equivalent of `full` is `apply_activation_checkpointing` (the wrapper FSDP
uses) on every block.

    python bench/remat_overhead.py --model small --batch 8 --seq-len 256 --iters 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from threefold.config import RematConfig, load_config
from threefold.models.decoder import Block, build_model
from threefold.observe.memory import SavedTensorMeter
from threefold.parallel.remat import apply_remat


def one_step(model, tokens, meter: SavedTensorMeter) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    meter.reset()
    with meter.measure():
        loss = model(tokens, tokens)
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.preset={args.model}"]).model
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    def native():
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                 apply_activation_checkpointing,
                                                                                 checkpoint_wrapper)
        model = build_model(cfg, 0)
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, Block))
        return model

    def ours(policy: RematConfig):
        model = build_model(cfg, 0)
        apply_remat(model, policy)
        return model

    cases = [("none", lambda: ours(RematConfig("none"))), ("full", lambda: ours(RematConfig("full"))),
             ("every-k (k=2)", lambda: ours(RematConfig("every-k", every=2))),
             ("selective (attn.core)", lambda: ours(RematConfig("selective"))),
             ("torch apply_activation_checkpointing", native)]
    models = [(name, build()) for name, build in cases]
    meters = [SavedTensorMeter(exclude=list(model.parameters())) for _, model in models]
    times: list[list[float]] = [[] for _ in models]
    for i in range(args.iters + 1):  # round robin, so a busy machine slows every policy alike
        for k, (_, model) in enumerate(models):
            seconds = one_step(model, tokens, meters[k])
            if i:  # the first round warms up
                times[k].append(seconds)
    print(f"model {args.model}, batch {args.batch}, seq {args.seq_len}, {torch.get_num_threads()} threads, "
          f"{args.iters} rounds")
    print(f"{'policy':38} {'min s':>7} {'median s':>9} {'vs none':>8} {'saved bytes':>13} {'vs none':>8}")
    base_t, base_b = min(times[0]), meters[0].current
    for (name, _), ts, meter in zip(models, times, meters):
        print(f"{name:38} {min(ts):7.3f} {statistics.median(ts):9.3f} {min(ts) / base_t:7.2f}x "
              f"{meter.current:13,d} {meter.current / base_b:7.2f}x")
    print("ratios use the fastest round of each; target: full <= 1.35x the time of none")


if __name__ == "__main__":
    main()
