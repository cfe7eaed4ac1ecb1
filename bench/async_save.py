"""Training-loop stall of a synchronous vs an asynchronous checkpoint save of the same state.

One process trains a model whose parameters + AdamW states exceed 200 MB and saves it:
`--rounds` synchronous saves, then `--rounds` asynchronous ones (consecutive, so an async save
meets its predecessor's write as it would in training), `--every` steps after each save.

The stall is the time the training loop waits for checkpointing: the `save_checkpoint()` call
(for a synchronous save the whole write: snapshot, safetensors file, fsync, sha256, manifest,
rename; for an asynchronous one any wait for the previous write) plus the next optimizer step's
wait for the snapshot (`Checkpointer.last_stall_s`, read after the steps that follow the save).
Steps that run slower while a write runs are printed apart. PyTorch's distributed checkpoint
(`torch.distributed.checkpoint.save` / `async_save`) of the same tensors runs afterwards; its
stall is the save call (its staging copy included) plus the wait for its previous write.

    python bench/async_save.py [--hidden 768] [--layers 3] [--rounds 3] [--every 2] [--out bench/out/async_save]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from threefold.config import load_config
from threefold.train.trainer import Trainer


def build(args) -> Trainer:
    out = Path(args.out) / "threefold"
    shutil.rmtree(out, ignore_errors=True)
    return Trainer(load_config(None, [
        "model.preset=tiny", f"model.hidden={args.hidden}", f"model.layers={args.layers}",
        f"model.ffn_hidden={4 * args.hidden}", "model.heads=12", "model.kv_heads=12", "model.vocab=256",
        "train.global_batch=2", "train.seq_len=16", "train.steps=1000", f"run.out={out}", "run.progress=false",
        "run.plot=false", "checkpoint.keep=2"]))


def steps(trainer: Trainer, n: int, plain: list, busy: list) -> None:
    for _ in range(n):
        running = trainer.checkpointer.writer.busy()
        t0 = time.perf_counter()
        trainer.train_one_step()
        (busy if running else plain).append(time.perf_counter() - t0)


def bench_threefold(trainer: Trainer, args) -> dict:
    ckpt = trainer.checkpointer
    stalls = {"sync": [], "async": []}
    plain, busy = [], []
    for mode in ("sync", "async"):
        ckpt.wait()  # between the modes only
        ckpt.async_save = mode == "async"
        for _ in range(args.rounds):
            trainer.save_checkpoint()  # waits for the previous async write itself, when one still runs
            steps(trainer, args.every, plain, busy)
            # read after the steps: the next optimizer step's wait for the snapshot is added to it
            stalls[mode].append(ckpt.last_stall_s)
    ckpt.wait()
    writes = [ckpt.last_write_s]
    # the worst case, a step too short to hide the copy: the snapshot alone, into the warm buffers
    from threefold.checkpoint.writer import snapshot

    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        snapshot(trainer.training_state().entries(), ckpt.coords, ckpt._staging)
        copies.append(time.perf_counter() - t0)
    return {"stalls": stalls, "writes": writes, "plain": plain, "busy": busy, "copy": statistics.median(copies)}


def dcp_state(trainer: Trainer) -> dict:
    """The same tensors as threefold's checkpoint: the model's parameters and the optimizer's states."""
    optimizer = {f"{i}.{kind}": value for i, state in enumerate(trainer.optimizer.state.values())
                 for kind, value in state.items()}
    return {"model": trainer.parallel.module.state_dict(), "optim": optimizer}


def bench_dcp(trainer: Trainer, args) -> dict:
    """torch.distributed.checkpoint of the same state, with the same steps between saves: the
    stall is the save call plus the wait for the previous write, as threefold's."""
    import torch.distributed.checkpoint as dcp

    stalls = {"sync": [], "async": []}
    for mode in ("sync", "async"):
        pending = None
        for i in range(args.rounds):
            target = Path(args.out) / f"dcp-{mode}-{i}"
            shutil.rmtree(target, ignore_errors=True)
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()
            if mode == "sync":
                dcp.save(dcp_state(trainer), checkpoint_id=str(target))
            else:
                pending = dcp.async_save(dcp_state(trainer), checkpoint_id=str(target))
            stalls[mode].append(time.perf_counter() - t0)
            steps(trainer, args.every, [], [])
        if pending is not None:
            pending.result()
    return stalls


def ms(values) -> str:
    return "[" + ", ".join(f"{v * 1e3:.0f}" for v in values) + "] ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--out", default="bench/out/async_save")
    parser.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    args = parser.parse_args()
    trainer = build(args)
    steps(trainer, 1, [], [])  # AdamW creates its state on the first step
    r = bench_threefold(trainer, args)
    state_mb = sum(e.tensor.numel() * e.tensor.element_size() for e in trainer.training_state().entries()) / 1e6
    sync, asyn = r["stalls"]["sync"], r["stalls"]["async"]
    print(f"state: {state_mb:.0f} MB (parameters + AdamW states), {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds of (save, {args.every} steps) per mode; stall = the save call (with any wait for "
          f"the previous write) + the next optimizer step's wait for the snapshot; load average {os.getloadavg()[0]:.1f}")
    print(f"threefold sync  save stall: median {statistics.median(sync) * 1e3:7.1f} ms  {ms(sync)}")
    print(f"threefold async save stall: median {statistics.median(asyn) * 1e3:7.1f} ms  {ms(asyn)} "
          f"(snapshot overlapped with the next forward/backward)")
    print(f"stall ratio sync / async: {statistics.median(sync) / statistics.median(asyn):.1f}x  (target >= 25x)")
    print(f"worst case (a step too short to hide the snapshot): snapshot alone {r['copy'] * 1e3:.1f} ms, ratio "
          f"{statistics.median(sync) / r['copy']:.1f}x")
    print(f"background write of the last async save: {ms(r['writes'])}; step time {statistics.median(r['plain']) * 1e3:.0f} ms "
          f"alone, {statistics.median(r['busy'] or [float('nan')]) * 1e3:.0f} ms while a write runs")
    if args.no_dcp:
        return
    try:
        d = bench_dcp(trainer, args)
    except Exception as e:  # a reference only: report and go on
        print(f"torch.distributed.checkpoint: unavailable here ({type(e).__name__}: {e})")
        return
    dsync, dasync = statistics.median(d["sync"]), statistics.median(d["async"])
    print(f"torch.distributed.checkpoint stall: save median {dsync * 1e3:.1f} ms {ms(d['sync'])}, async_save "
          f"median {dasync * 1e3:.1f} ms {ms(d['async'])}, ratio {dsync / dasync:.1f}x")
    print(f"threefold / torch stall: sync {statistics.median(sync) / dsync:.2f}x, async "
          f"{statistics.median(asyn) / dasync:.2f}x (below 1: threefold stalls less)")


if __name__ == "__main__":
    main()
