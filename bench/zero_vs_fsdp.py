"""threefold ZeRO stages 0-3 against each other, and ZeRO-3 against PyTorch FSDP2 (`fully_shard`).

Same model (the reference decoder), same data, same world size, same step math (summed token
loss / global tokens, gradients summed over ranks, clipping by the global norm, AdamW). Prints,
per implementation: throughput, bytes each rank sends per step over dp (ring volumes: threefold
from `comm/`, FSDP2 from its collectives intercepted with the same formulas), model-state
bytes per rank (each storage counted once), saved activations, and the final loss.

Alternating rounds (every implementation once per round, the order reversed every other round)
so load from other processes falls on all alike; per-round ratios with their spread. FSDP2's
bytes are counted by a dispatch-mode interceptor in its first, untimed step only (threefold
counts in its Comm layer, always on); each side uses its usual AdamW (threefold's
sharded fp32-master optimizer, foreach; torch.optim.AdamW(foreach=True) on FSDP2).

    python bench/zero_vs_fsdp.py --nproc 2 --model small --steps 8 --seq-len 128 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from threefold.launch.world import World


def threefold_run(overrides: list[str]) -> dict:
    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides + ["run.progress=false", "run.plot=false"]))
    records = trainer.run()
    dp_bytes = {op: n for op, n in records[-1]["comm"].get("dp", {}).items() if "." not in op}
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:]),
            "dp_bytes": dp_bytes, "mem": records[-1]["mem"], "loss": records[-1]["loss"]}


class _CountCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank sends in FSDP2's collectives, by the ring formulas of comm/collectives.py."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "allgather_base" in name or "all_gather_into_tensor" in name:
            out, inp = args[0], args[1]
            self._add("all_gather", (out.numel() - inp.numel()) * inp.element_size())
        elif "reduce_scatter_base" in name or "reduce_scatter_tensor" in name:
            out, inp = args[0], args[1]
            self._add("reduce_scatter", (inp.numel() - out.numel()) * inp.element_size())
        return func(*args, **(kwargs or {}))

    def _add(self, op: str, n: int) -> None:
        self.bytes[op] = self.bytes.get(op, 0) + n


def fsdp2_run(overrides: list[str]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from threefold.config import load_config
    from threefold.data import Sampler, load_tokens
    from threefold.models.decoder import build_model
    from threefold.observe.memory import storage_bytes
    from threefold.train.optim import lr_at, param_groups, set_lr

    cfg = load_config(None, overrides).validate(dist.get_world_size())
    t, n, rank = cfg.train, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, t.seed)
    mesh = init_device_mesh("cpu", (n,))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.compute]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # AdamW with the foreach implementation, as threefold's own update uses (and torch's default on CUDA;
    # on CPU torch's default would be the slower single-tensor loop, which is not the comparison made here)
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), t.weight_decay), lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    tokens = t.global_batch * t.seq_len
    speeds, counter = [], _CountCollectives()

    def step(number: int) -> torch.Tensor:
        loss_sum = torch.zeros(())
        for mb in sampler.microbatches(number - 1, t.microbatches, rank, n, torch.device("cpu")):
            loss = model(mb.inputs, mb.targets)
            # FSDP2 averages gradients over ranks (a summing divide factor needs PREMUL_SUM, which
            # gloo lacks): scaling by n makes the average the sum of threefold's step math
            (loss * n / tokens).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        set_lr(optimizer, lr_at(number, t))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss_sum)
        return loss_sum

    with counter:  # step 1 (warm-up, untimed, as on the threefold side) counts the bytes
        loss_sum = step(1)
    for number in range(2, t.steps + 1):  # timed, without the counter
        start = time.perf_counter()
        loss_sum = step(number)
        speeds.append(tokens / (time.perf_counter() - start))
    local = [p.to_local() for p in model.parameters()]
    states = [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values() for v in s.values()]
    return {"tokens_per_s": statistics.median(speeds), "dp_bytes": dict(counter.bytes),
            "mem": {"params": storage_bytes(local),
                    "grads": storage_bytes(p.grad.to_local() for p in model.parameters() if p.grad is not None),
                    "optimizer": storage_bytes(v for v in states if v.dim() > 0), "activations": None},
            "loss": float(loss_sum) / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    failed: dict[str, str] = {}
    common = [f"model.preset={args.model}", f"train.steps={args.steps}", f"train.global_batch={args.global_batch}",
              f"train.seq_len={args.seq_len}", f"precision.compute={args.precision}", "data.source=stdlib",
              "run.out=runs/bench-zero"]
    sides = [(f"threefold ZeRO-{stage}", threefold_run, common + [f"parallel.zero={stage}"]) for stage in range(4)]
    sides.append(("torch FSDP2 fully_shard", fsdp2_run, common))
    per_round: dict[str, list[dict]] = {name: [] for name, _, _ in sides}
    load = [os.getloadavg()[0]]
    with World(args.nproc, timeout_s=1800) as world:
        for r in range(args.rounds):  # alternating rounds, the order reversed every other round
            for name, fn, overrides in (sides if r % 2 == 0 else sides[::-1]):
                if name in failed:
                    continue
                try:
                    per_round[name].append(world.run(fn, overrides)[0])
                except Exception as e:  # noqa: BLE001 - report why the native side could not run
                    failed[name] = str(e).strip().splitlines()[-1]
                    print(f"{name} did not run on this backend: {failed[name]}")
            load.append(os.getloadavg()[0])
    rows = [(name, median_run(runs)) for name, runs in per_round.items() if runs]
    print(f"\nworld {args.nproc}, model {args.model}, seq {args.seq_len}, global batch {args.global_batch}, "
          f"{args.precision}, {args.steps} steps per run (first untimed), {args.rounds} alternating rounds, "
          f"median (rank 0); load average {' -> '.join(f'{x:.1f}' for x in load)}")
    header = f"{'implementation':26} {'tokens/s':>9} {'[q1, q3] over rounds':>20} {'dp bytes/step':>14} {'params':>10} {'grads':>10} " \
             f"{'optimizer':>10} {'state total':>11} {'activations':>11} {'final loss':>10}"
    print(header)
    print("-" * len(header))
    for name, r in rows:
        m = r["mem"]
        total = m["params"] + m["grads"] + m["optimizer"] + m.get("offloaded", 0)
        print(f"{name:26} {r['tokens_per_s']:9.0f} {spread(per_round[name]):>20} {sum(r['dp_bytes'].values()):14,d} {m['params']:10,d} "
              f"{m['grads']:10,d} {m['optimizer']:10,d} {total:11,d} "
              f"{m['activations'] if m['activations'] is not None else '-':>11} {r['loss']:10.4f}")
    named = dict(rows)

    def ratios(a: str, b: str) -> str:
        """Per-round throughput ratio a / b: median and spread."""
        x = [ra["tokens_per_s"] / rb["tokens_per_s"] for ra, rb in zip(per_round[a], per_round[b])]
        q1, med, q3 = statistics.quantiles(x, n=4, method="inclusive") if len(x) > 1 else (x[0],) * 3
        return f"{med:.2f}x [q1 {q1:.2f}, q3 {q3:.2f}; {min(x):.2f}-{max(x):.2f}]"

    if "torch FSDP2 fully_shard" in named:
        ours, theirs = named["threefold ZeRO-3"], named["torch FSDP2 fully_shard"]
        print(f"\nZeRO-3 / FSDP2: throughput {ratios('threefold ZeRO-3', 'torch FSDP2 fully_shard')}, "
              f"bytes sent {sum(ours['dp_bytes'].values()) / max(1, sum(theirs['dp_bytes'].values())):.2f}x, "
              f"final loss difference {abs(ours['loss'] - theirs['loss']):.2e}")
    print("throughput relative to ZeRO-0: " + ", ".join(
        f"ZeRO-{s} {ratios(f'threefold ZeRO-{s}', 'threefold ZeRO-0')}" for s in range(1, 4)))
    base = sum(named["threefold ZeRO-0"]["dp_bytes"].values())
    print("bytes sent relative to plain DP: " + ", ".join(
        f"ZeRO-{s} {sum(named[f'threefold ZeRO-{s}']['dp_bytes'].values()) / base:.2f}x" for s in range(4)))


def spread(runs: list[dict]) -> str:
    """The first and third quartile of the rounds' tokens/s."""
    x = [r["tokens_per_s"] for r in runs]
    q1, _, q3 = statistics.quantiles(x, n=4, method="inclusive") if len(x) > 1 else (x[0],) * 3
    return f"[{q1:.0f}, {q3:.0f}]"


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (its bytes, memory and loss are the same in every round)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]

if __name__ == "__main__":
    main()
