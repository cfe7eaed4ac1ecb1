"""threefold data parallelism against torch DistributedDataParallel, side by side.

Same model, data, optimizer and world size; both loops do forward, backward with bucketed
all-reduce, global-norm clipping and an AdamW step. Timed rounds alternate between the two
so that machine noise hits both alike. Each side has the AdamW its users get: threefold's
fp32-master optimizer (foreach), torch.optim.AdamW(foreach=True) on DDP (torch's default on CUDA;
on CPU its default is the slower single-tensor loop). Prints tokens/s of each, their ratio, the
per-round ratios' median, quartiles and extremes, and threefold's counted bytes per step against
the ring all-reduce volume 2(n-1)/n x gradient bytes.

    python bench/dp_vs_ddp.py [--sizes 2 4] [--model small] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from threefold.comm import Comm
from threefold.config import load_config
from threefold.data import Sampler, load_tokens
from threefold.mesh import Layout, Mesh
from threefold.models.decoder import build_model
from threefold.models.registry import model_spec
from threefold.parallel import parallelize
from threefold.train.optim import param_groups
from threefold.train.step import TrainStep
from threefold.launch.world import World


def bench_rank(args: dict) -> dict:
    n = torch.distributed.get_world_size()
    cfg = load_config(None, [f"model.preset={args['model']}", f"train.seq_len={args['seq_len']}",
                             f"train.global_batch={args['batch_per_rank'] * n}"]).validate(n)
    mesh = Mesh(Layout(dp=n), torch.device("cpu"))
    comm = Comm(mesh)
    sampler = Sampler(load_tokens("synthetic", cfg.model.vocab), cfg.train.seq_len, cfg.train.global_batch, 0)
    tokens = cfg.train.global_batch * cfg.train.seq_len

    ours = parallelize(model_spec(cfg.model, 0), mesh, comm, cfg)
    # the trainer's own path: fp32-master AdamW over this rank's pieces
    step_fn = TrainStep(ours, ours.make_optimizer(cfg.train), comm, cfg.train)

    ddp = DistributedDataParallel(build_model(cfg.model, 0), bucket_cap_mb=cfg.parallel.bucket_mb)
    t = cfg.train
    ddp_opt = torch.optim.AdamW(param_groups(ddp.module.named_parameters(), t.weight_decay), lr=t.lr,
                                betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)

    def ours_step(step):
        step_fn(step, sampler.microbatches(step, 1, mesh.rank("dp"), n), tokens)

    def ddp_step(step):
        (mb,) = sampler.microbatches(step, 1, mesh.rank("dp"), n)
        ddp_opt.zero_grad(set_to_none=False)
        # DDP averages gradients: scale the summed loss so both optimise the same global mean
        (ddp(mb.inputs, mb.targets) * n / tokens).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.train.grad_clip)
        ddp_opt.step()

    times = {"threefold": [], "ddp": []}
    for warm in range(2):
        ours_step(warm + 1)
        ddp_step(warm + 1)
    comm.traffic.take_window()
    for r in range(args["rounds"]):  # alternating, the order reversed every other round
        sides = (("threefold", ours_step), ("ddp", ddp_step))
        for name, fn in (sides if r % 2 == 0 else sides[::-1]):
            torch.distributed.barrier()
            start = time.perf_counter()
            for s in range(args["steps"]):
                fn(s + 3)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    window = comm.traffic.take_window()
    measured_steps = args["steps"] * args["rounds"]
    grad_bytes = ours.grad_sync.gradient_bytes()
    return {"tokens_per_s": {k: tokens * measured_steps / sum(t) for k, t in times.items()},
            "round_ratios": [d / o for o, d in zip(times["threefold"], times["ddp"])],
            "bytes_per_step": window["dp"]["all_reduce"] / measured_steps, "grad_bytes": grad_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = vars(parser.parse_args())
    print(f"model={args['model']} seq_len={args['seq_len']} batch/rank={args['batch_per_rank']} gloo CPU")
    print(f"{'procs':>5} {'threefold tok/s':>16} {'DDP tok/s':>10} {'ratio':>6} {'rounds min-max':>15} "
          f"{'round ratio median [q1, q3]':>28} {'bytes/step/rank':>16} {'2(n-1)/n x grads':>17} {'load':>5}")
    for n in args["sizes"]:
        with World(n, threads=max(1, torch.get_num_threads() // n)) as world:
            r = world.run(bench_rank, args)[0]
        ours, ddp = r["tokens_per_s"]["threefold"], r["tokens_per_s"]["ddp"]
        theory = 2 * (n - 1) / n * r["grad_bytes"]
        x = r["round_ratios"]
        spread = f"{min(x):.3f}-{max(x):.3f}"
        q1, med, q3 = statistics.quantiles(x, n=4, method="inclusive") if len(x) > 1 else (x[0],) * 3
        quart = f"{med:.3f} [{q1:.3f}, {q3:.3f}]"
        print(f"{n:>5} {ours:>16.0f} {ddp:>10.0f} {ours / ddp:>6.3f} {spread:>15} {quart:>28} "
              f"{r['bytes_per_step']:>16.0f} "
              f"{theory:>17.0f} {os.getloadavg()[0]:>5.1f}")


if __name__ == "__main__":
    main()
