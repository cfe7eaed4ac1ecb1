"""threefold tensor parallelism against PyTorch's DTensor tensor parallelism, side by side.

Same model (the reference decoder, untied head so both can split it), same data, same AdamW
(foreach on both sides, as the trainer's optimizer and torch's CUDA default are; on CPU torch's
default would be the slower single-tensor loop), same tp world on CPU / gloo. threefold applies
the decoder's plan (heads, MLP, vocab-parallel embedding, head and loss); DTensor gets
`parallelize_module` with the equivalent styles: ColwiseParallel for q, k, v, up (gate),
RowwiseParallel for o and down, RowwiseParallel for the token embedding and ColwiseParallel with
a replicated output for the head (whole logits, then the model's usual loss). Timed rounds
alternate which side goes first, so that machine noise hits both alike. Prints tokens/s of each
(median and quartiles over the rounds) and their ratio, the first losses of both (the same
model, so they agree), and threefold's counted tp bytes per step.

    python bench/tp_vs_dtensor.py [--tp 2] [--model small] [--seq-len 128] [--batch 8] [--steps 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch

from threefold.comm import Comm
from threefold.config import load_config
from threefold.data import Sampler, load_tokens
from threefold.mesh import Layout, Mesh
from threefold.models.decoder import build_model
from threefold.models.decoder_plan import decoder_plan
from threefold.parallel.tensor_plan import parallelize_tensor
from threefold.train.optim import param_groups
from threefold.launch.world import World


def dtensor_plan(cfg) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embed.tok": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(cfg.layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up") + (("mlp.gate",) if cfg.mlp == "swiglu" else ()):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def foreach_adamw(named_params, t) -> torch.optim.Optimizer:
    """AdamW with foreach steps; DTensor parameters and plain ones (the norms DTensor leaves alone) in
    groups of their own, as foreach kernels cannot mix them (foreach set per group: zero_grad's own
    foreach path would gather the gradients of all groups into one list)."""
    from torch.distributed.tensor import DTensor

    groups = []
    for group in param_groups(named_params, t.weight_decay):
        for is_dtensor in (False, True):
            params = [p for p in group["params"] if isinstance(p, DTensor) == is_dtensor]
            if params:
                groups.append({**group, "params": params, "foreach": True})
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def bench_rank(args: dict) -> dict:
    tp = torch.distributed.get_world_size()
    cfg = load_config(None, [f"model.preset={args['model']}", "model.tie_embeddings=false",
                             f"train.seq_len={args['seq_len']}", f"train.global_batch={args['batch']}",
                             f"parallel.tp={tp}"]).validate(tp)
    mesh = Mesh(Layout(tp=tp), torch.device("cpu"))
    comm = Comm(mesh)
    sampler = Sampler(load_tokens("synthetic", cfg.model.vocab), cfg.train.seq_len, cfg.train.global_batch, 0)
    tokens = cfg.train.global_batch * cfg.train.seq_len

    ours = build_model(cfg.model, 0)
    parallelize_tensor(ours, mesh, comm, decoder_plan(cfg.model), args["sp"])
    ours_opt = foreach_adamw(ours.named_parameters(), cfg.train)
    steps = {"threefold": (ours, ours_opt)}
    dtensor_error = None
    try:
        from torch.distributed.tensor.parallel import parallelize_module

        theirs = parallelize_module(build_model(cfg.model, 0), mesh.device_mesh["tp"], dtensor_plan(cfg.model))
        steps["dtensor"] = (theirs, foreach_adamw(theirs.named_parameters(), cfg.train))
    except Exception as e:  # report why DTensor cannot run here instead of failing the benchmark
        dtensor_error = f"{type(e).__name__}: {e}"

    def one_step(name, step):
        model, opt = steps[name]
        (mb,) = sampler.microbatches(step, 1)
        opt.zero_grad(set_to_none=False)
        loss = model(mb.inputs, mb.targets)
        (loss / tokens).backward()
        opt.step()
        return float(loss.detach()) / tokens

    first_losses = {}
    for name in list(steps):
        try:
            first_losses[name] = [one_step(name, s) for s in range(2)]  # warm-up, and a correctness glance
        except Exception:
            if name == "threefold":
                raise
            dtensor_error = traceback.format_exc(limit=2).strip().splitlines()[-1]
            del steps[name]
    comm.traffic.take_window()
    rates = {name: [] for name in steps}  # tokens/s of each round
    for round_ in range(args["rounds"]):
        order = list(steps) if round_ % 2 == 0 else list(steps)[::-1]  # alternate which side goes first
        for name in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            for s in range(args["steps"]):
                one_step(name, s + 2)
            torch.distributed.barrier()
            rates[name].append(tokens * args["steps"] / (time.perf_counter() - start))
    measured = args["steps"] * args["rounds"]
    tp_bytes = sum(comm.traffic.take_window().get("tp", {}).values())
    quartiles = {k: statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
                 for k, v in rates.items()}
    return {"tokens_per_s": {k: q[1] for k, q in quartiles.items()}, "quartiles": quartiles,
            "first_losses": first_losses, "tp_bytes_per_step": tp_bytes / measured, "dtensor_error": dtensor_error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequence-parallel", action="store_true")
    a = parser.parse_args()
    args = {"model": a.model, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps, "rounds": a.rounds,
            "sp": a.sequence_parallel}
    with World(a.tp) as world:
        r = world.run(bench_rank, args)[0]
    print(f"model={a.model} tp={a.tp} batch={a.batch} seq_len={a.seq_len} sequence_parallel={a.sequence_parallel} "
          f"(CPU, gloo)")
    print(f"  {a.rounds} rounds of {a.steps} steps, alternating which side goes first; tokens/s median [q1, q3]")
    for name, tps in r["tokens_per_s"].items():
        losses = " ".join(f"{x:.5f}" for x in r["first_losses"][name])
        q1, _, q3 = r["quartiles"][name]
        print(f"  {name:10s} {tps:10.0f} tokens/s [{q1:.0f}, {q3:.0f}]   first losses {losses}")
    if r["dtensor_error"]:
        print(f"  dtensor    did not run on CPU/gloo: {r['dtensor_error']}")
    else:
        print(f"  ratio threefold / dtensor: {r['tokens_per_s']['threefold'] / r['tokens_per_s']['dtensor']:.2f}")
    print(f"  threefold tp bytes sent per step per rank: {r['tp_bytes_per_step']:.0f}")


if __name__ == "__main__":
    main()
