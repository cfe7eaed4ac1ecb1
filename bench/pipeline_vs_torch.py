"""threefold's pipeline runtime against torch.distributed.pipelining, side by side (CPU, gloo).

Same model (the reference decoder, untied so both frameworks hold plain stage modules), same
stage split, same p and m, same schedule, same micro-batches and initial weights. Reports the
median forward+backward time of one step for each and the ratio of the two per round: its median,
its interquartile range and its extremes, and in how many rounds threefold was the faster; and
checks that both produce the same loss and gradients. zb-v and dualpipev run against torch's
ScheduleZBVZeroBubble and ScheduleDualPipeV (the same V placement: rank r holds stages r and
2p - 1 - r). A schedule that PyTorch cannot run here
prints its error.

    PYTHONPATH=src python bench/pipeline_vs_torch.py [--pp 2] [--microbatches 4] [--steps 51]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

# schedule -> (torch class name, stages per rank); the V schedules place their two chunks themselves
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2), "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
             "zb-v": ("ScheduleZBVZeroBubble", 2), "dualpipev": ("ScheduleDualPipeV", 2)}
V_SCHEDULES = ("zb-v", "dualpipev")


class TorchStage(nn.Module):
    """One stage for torch.distributed.pipelining: tokens or x_bsh in, x_bsh or logits out."""

    def __init__(self, model, stage):
        super().__init__()
        self.stage = stage
        self.embed = model.embed if stage.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in stage.layers)
        self.norm = model.norm if stage.last else None
        self.head = model.head if stage.last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def run_rank(schedule_name: str, overrides: list[str], steps: int) -> dict:
    import torch.distributed.pipelining as pipelining

    from threefold.comm import Comm
    from threefold.config import load_config
    from threefold.data import Sampler, load_tokens
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.pipeline import split_pipeline

    torch_class, v = SCHEDULES[schedule_name]
    virtual = 1 if schedule_name in V_SCHEDULES else v
    cfg = load_config(None, overrides + [f"pipeline.schedule={schedule_name}", f"pipeline.virtual_stages={virtual}"])
    world = torch.distributed.get_world_size()
    cfg = cfg.validate(world)
    mesh = Mesh(Layout(pp=world), torch.device("cpu"))
    comm = Comm(mesh)
    m, tokens_per_step = cfg.train.microbatches, cfg.train.global_batch * cfg.train.seq_len
    sampler = Sampler(load_tokens("synthetic", cfg.model.vocab, 0), cfg.train.seq_len, cfg.train.global_batch, 0)
    micro = sampler.microbatches(0, m)
    result = {}

    # --- threefold
    split = split_pipeline(build_model(cfg.model, seed=0), mesh, comm, cfg)
    runtime = split.runtime(comm, grad_sync=None)

    def threefold_step():
        for p in split.module.parameters():
            p.grad = None
        return runtime.forward_backward(micro, tokens_per_step)

    # --- torch.distributed.pipelining on a fresh copy of the same weights and split
    model = build_model(cfg.model, seed=0)
    modules = [TorchStage(model, s) for s in split.stages]
    torch_step = None
    try:
        group = mesh.group("pp")
        stages = [pipelining.PipelineStage(mod, s.index, len(split.all_stages), torch.device("cpu"), group=group)
                  for mod, s in zip(modules, split.stages)]

        def loss_fn(logits, targets):  # the same step math: summed token loss / global tokens
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens_per_step

        cls = getattr(pipelining, torch_class)
        schedule = cls(stages if v > 1 or torch_class.startswith("ScheduleInterleaved") else stages[0], m,
                       loss_fn=loss_fn, scale_grads=False)
        inputs = torch.cat([b.inputs for b in micro])
        holds_first, holds_last = any(s.first for s in split.stages), any(s.last for s in split.stages)
        targets = torch.cat([b.targets for b in micro])

        def torch_step():
            for mod in modules:
                mod.zero_grad(set_to_none=True)
            losses = []
            if holds_first:  # under the V placement rank 0 holds the first and the last stage
                schedule.step(inputs, target=targets if holds_last else None, losses=losses)
            elif holds_last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            return losses

        torch_step()  # warm-up; errors surface here
    except Exception as e:  # report, do not hide, what PyTorch's pipelining cannot do here
        result["torch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    # alternating rounds: each round times one step of each side, the order swapped every round,
    # so load from other processes falls on both sides alike
    loss = threefold_step()  # warm-up
    sides = {"threefold": threefold_step} | ({"torch": torch_step} if "torch_error" not in result else {})
    times = {name: [] for name in sides}
    timelines, losses = [], []
    for r in range(steps):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            comm.barrier("pp")
            start = time.perf_counter()
            out = sides[name]()
            times[name].append(time.perf_counter() - start)
            if name == "threefold":
                loss = out
                timelines.append(runtime.gathered_timeline())  # outside the timed region
            else:
                losses = out
    result["threefold_times"] = times["threefold"]
    comm.all_reduce(loss, "pp")
    result["threefold_loss"] = float(loss) / tokens_per_step
    result["timelines"] = timelines
    if "torch" in times:
        result["torch_times"] = times["torch"]
        total = torch.tensor(sum(float(x.detach()) for x in losses), dtype=torch.float32)
        comm.all_reduce(total, "pp")
        result["torch_loss"] = float(total)
        ours = {split.names[n]: p.grad.clone() for n, p in split.module.named_parameters() if p.grad is not None}
        theirs = {}
        for mod, s in zip(modules, split.stages):
            for n, p in mod.named_parameters():
                if p.grad is not None:
                    theirs[_global_name(n, s)] = p.grad
        errs = [float((ours[k] - g).norm() / g.norm()) for k, g in theirs.items() if k in ours and g.norm() > 0]
        result["max_grad_rel_diff"] = max(errs) if errs else float("nan")
    return result


def _global_name(local: str, stage) -> str:
    """TorchStage names ("blocks.0.x" = the stage's first layer) -> the model's global names."""
    if local.startswith("blocks."):
        _, index, rest = local.split(".", 2)
        return f"blocks.{stage.layers[int(index)]}.{rest}"
    return local


def step_times(results: list[dict], key: str) -> list[float]:
    """Per round: the slowest rank's time of that side's step (the step ends when every rank is done)."""
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def split_costs(timelines: list) -> dict:
    """Median per round of: bubble (mean over ranks, from the recorded busy intervals), and
    seconds of B, or of I + W, summed over all ranks."""
    from threefold.pipeline.timeline import bubble_fractions

    pp = 1 + max(e.rank for e in timelines[0])
    bubbles = [statistics.mean(bubble_fractions(events, pp)) for events in timelines]
    backward = [sum(e.end - e.start for e in events if e.kind in "BIW") for events in timelines]
    return {"bubble": statistics.median(bubbles), "backward_s": statistics.median(backward)}


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=51, help="alternating rounds (one step of each side each)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    from threefold.launch.world import World

    overrides = ["model.preset=small", "model.tie_embeddings=false", "model.layers=4", "train.seq_len=64",
                 "train.global_batch=16", f"train.microbatches={args.microbatches}", f"parallel.pp={args.pp}"]
    print(f"model small (4 layers, hidden 256, untied), seq 64, batch 16, pp={args.pp}, m={args.microbatches}, "
          f"CPU gloo, 1 thread per rank; {args.steps} alternating rounds of one forward+backward step each; "
          f"load average before: {os.getloadavg()[0]:.1f}")
    print(f"{'schedule':<12}{'threefold s':>12}{'torch s':>10}{'torch/threefold':>17}{'(p25-p75)':>13}{'(min-max)':>13}"
          f"{'faster':>8}{'loss diff':>11}{'grad diff':>11}{'bubble':>8}{'backward s':>11}")
    costs = {}
    with World(args.pp, timeout_s=900) as world:
        for name in args.schedules.split(","):
            results = world.run(run_rank, name, overrides, args.steps)
            ours = step_times(results, "threefold_times")
            costs[name] = split_costs(results[0]["timelines"])
            tail = f"{costs[name]['bubble']:>8.3f}{costs[name]['backward_s']:>11.3f}"
            errors = [r["torch_error"] for r in results if "torch_error" in r]
            if errors:
                print(f"{name:<12}{statistics.median(ours):>12.3f}  torch.distributed.pipelining failed: {errors[0]}")
                continue
            theirs = step_times(results, "torch_times")
            ratios = [t / o for t, o in zip(theirs, ours)]
            loss_diff = abs(results[0]["threefold_loss"] - results[0]["torch_loss"])
            grad_diff = max(r["max_grad_rel_diff"] for r in results)
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            quartiles, spread = f"({q1:.2f}-{q3:.2f})", f"({min(ratios):.2f}-{max(ratios):.2f})"
            faster = f"{sum(r > 1 for r in ratios)}/{len(ratios)}"
            print(f"{name:<12}{statistics.median(ours):>12.3f}{statistics.median(theirs):>10.3f}"
                  f"{statistics.median(ratios):>17.3f}{quartiles:>13}{spread:>13}{faster:>8}"
                  f"{loss_diff:>11.1e}{grad_diff:>11.1e}{tail}")
    for zero_bubble in ("zb-h1", *V_SCHEDULES):
        if zero_bubble in costs and "1f1b" in costs:
            zb, one = costs[zero_bubble], costs["1f1b"]
            print(f"\nthreefold {zero_bubble} vs 1f1b: bubble {zb['bubble']:.3f} vs {one['bubble']:.3f} "
                  f"({zb['bubble'] / one['bubble']:.2f}x); backward {zb['backward_s']:.3f} s vs B "
                  f"{one['backward_s']:.3f} s over all ranks ({zb['backward_s'] / one['backward_s']:.2f}x)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
