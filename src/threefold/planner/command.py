"""`threefold plan`: will the model fit, and which layout is fastest.

With layout options (--dp --tp --pp --zero --microbatches --activation-checkpointing ...) the
planner evaluates that layout (searching only the knobs left open); without them it searches.
Prints a table (or `--json`: the contract in DESIGN.md, best first); `--scaling PNG` adds the
predicted throughput and scaling efficiency of the best layout from 8 to 8192 GPUs.
"""

from __future__ import annotations

import argparse
import math
import json
import sys
from dataclasses import replace

from ..config import load_config
from ..errors import ConfigError, UserError
from ..schedules import registry as pipeline_schedules
from .activation_offload import offload_advice
from .explain import breakdown, checkpoint_advice, layout_problems, parse_layout
from .mx import advice as mx_advice
from .hardware import NETWORKS, GiB, PRESETS, load_gpu, network, network_label, network_of, with_network
from .context_comm import METHODS as CP_METHODS
from .search import PlanResult, search, shortfall, slower, train_overrides
from .offload import HOST_GIB_PER_NODE, NVME_GBPS_PER_NODE, advise
from .optimizer import optimizers, optimizer_summary, plan_refusal
from .slow_links import advise as slow_link_advice
from .workload import Workload, active_parameters, total_parameters

FIXABLE = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "zero": "zero", "microbatches": "microbatches",
           "activation_checkpointing": "remat", "schedule": "schedule", "virtual_stages": "virtual_stages",
           "cp": "cp", "max_cp": "max_cp", "cp_method": "cp_method"}
DEFAULT_BATCH_TOKENS = 2**22  # ~4M tokens per step for the largest models (Llama 2 34B/70B, Touvron et al. 2023)
# When --global-batch is not given: the batch the published runs of a model's size used, in tokens per step:
# GPT-3's table 2.1 (Brown et al. 2020): 125M-760M 0.5M, 1.3B-2.7B 1M, 6.7B-13B 2M; 30B and up 4M (Llama 2).
# Below 125M, 0.5M shrinks in proportion to the parameters (a 36k-parameter model is not trained on 4M
# tokens a step); in sequences, the nearest power of two (so that dp divides it), at least one per GPU.
BATCH_TOKENS_BY_SIZE = ((30e9, 2**22), (6.7e9, 2**21), (1.3e9, 2**20), (125e6, 2**19))


def default_batch_tokens(params: int) -> int:
    """Tokens per step of the published runs of a model with `params` parameters (BATCH_TOKENS_BY_SIZE)."""
    for size, tokens in BATCH_TOKENS_BY_SIZE:
        if params >= size:
            return tokens
    return max(1, int(2**19 * params / 125e6))
# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100,
# i.e. one per ~50,700 GPU-hours
DEFAULT_MTBF_HOURS = 50_000
SCALING_GPUS = [8 * 2**i for i in range(11)]  # 8 .. 8192


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", metavar="NAME", help="preset of the reference model, or hf:DIR (a Hugging Face model directory)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="model field, repeatable, e.g. --set model.layers=48")
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    p.add_argument("--gpu", default="h100-80gb", metavar="KIND",
                   help=f"{', '.join(PRESETS)} or a .toml file with a [gpu] table (default h100-80gb)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: ~4M tokens)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "fp8", "mxfp8"],
                   help="fp8: the blocks' linears in float8 where their GEMM shape gains; mxfp8: the same in MXFP8 "
                        "(32-element blocks), which gains only where the GPU has MX tensor cores (Blackwell) "
                        "(docs/fp8.md, docs/planner.md)")
    p.add_argument("--optimizer", default="adamw", choices=optimizers(),
                   help="train.optimizer: its states per parameter from the optimizer registry and its step; muon "
                        "adds its Newton-Schulz work and whole-matrix exchange (docs/planner.md \"Optimizers\"; "
                        "default adamw)")
    p.add_argument("--network", metavar="NAME",
                   help=f"inter-node network, replacing the GPU kind's: {', '.join(NETWORKS)} (docs/planner.md, "
                        "\"Networks and presets\")")
    p.add_argument("--inter-gbps", type=float, metavar="GB/S",
                   help="inter-node bandwidth per GPU in Gb/s (bits), replacing the GPU kind's, e.g. 25 for a slow "
                        "network: the plan then says whether periodic sync or ZeRO++ options pay (overrides "
                        "--network's rate)")
    for opt in ("dp", "tp", "pp", "ep", "zero", "microbatches", "virtual_stages"):
        p.add_argument("--" + opt.replace("_", "-"), dest=opt, type=int, metavar="N", help=f"fix {opt}")
    p.add_argument("--cp", type=int, metavar="N",
                   help="fix context parallelism (parallel.cp): each sequence split over N ranks (docs/context.md); "
                        "the search tries cp > 1 only from 16k-token sequences")
    p.add_argument("--max-cp", dest="max_cp", type=int, metavar="N", help="bound the cp the search tries")
    p.add_argument("--cp-method", dest="cp_method", choices=list(CP_METHODS),
                   help="fix context parallelism's attention method (parallel.cp_method)")
    p.add_argument("--activation-checkpointing", choices=["none", "selective", "full", "every-k"], help="fix the policy")
    p.add_argument("--schedule", choices=list(pipeline_schedules.SCHEDULES), help="fix the pipeline schedule")
    p.add_argument("--explain", metavar="LAYOUT",
                   help="also print this layout's breakdown, e.g. 'dp=8 tp=8 pp=1 zero=2 ckpt=selective'")
    p.add_argument("--mtbf-hours", type=float, default=DEFAULT_MTBF_HOURS, metavar="H",
                   help=f"mean time between failures of one GPU, for the checkpoint advice (default {DEFAULT_MTBF_HOURS:,})")
    p.add_argument("--save-seconds", type=float, metavar="S",
                   help="stall of one checkpoint save (default: estimated from the bytes per GPU and --write-gbps)")
    p.add_argument("--write-gbps", type=float, default=1.0, metavar="GB/S",
                   help="checkpoint write rate per GPU in GB/s, to estimate the save (default 1)")
    p.add_argument("--restart-seconds", type=float, default=300.0, metavar="S",
                   help="time to restart after a failure (default 300)")
    p.add_argument("--host-gib", type=float, default=HOST_GIB_PER_NODE, metavar="GIB",
                   help=f"host memory per node for parallel.offload=optimizer (default {HOST_GIB_PER_NODE:g})")
    p.add_argument("--nvme-gbps", type=float, default=NVME_GBPS_PER_NODE, metavar="GB/S",
                   help=f"NVMe bandwidth per node for parallel.offload=nvme (default {NVME_GBPS_PER_NODE:g})")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--scaling", nargs="?", const="plan-scaling.png", metavar="PNG",
                   help="also predict 8..8192 GPUs and draw throughput and efficiency (default plan-scaling.png)")
    p.add_argument("--scaling-max", type=int, default=SCALING_GPUS[-1], metavar="N",
                   help=f"largest GPU count of --scaling (default {SCALING_GPUS[-1]})")


def _workload(args) -> tuple[Workload, str]:
    """The workload and, when the global batch was not given, a sentence saying what was assumed."""
    cfg = load_config(None, [f"model.preset={args.model}", *args.overrides])
    m = cfg.model
    seq = args.seq_len or m.max_seq
    if seq < 1:
        raise ConfigError("--seq-len", f"must be at least 1, got {seq}")
    if seq > m.max_seq:
        raise ConfigError("--seq-len", f"{seq} exceeds model.max_seq={m.max_seq}; add --set model.max_seq={seq}")
    params = total_parameters(m)
    by_size = 2 ** max(0, round(math.log2(max(1.0, default_batch_tokens(params) / seq))))  # a power of two divides
    batch = args.global_batch or by_size  # never raised here: `run` raises it, on a line of its own, only when
    # no layout of the GPUs can split it (`_raise_batch`)
    if batch < 1:
        raise ConfigError("--global-batch", f"must be at least 1, got {batch}")
    if m.hidden % m.heads or m.heads % m.kv_heads:
        raise ConfigError("model.hidden", "hidden must divide by heads and heads by kv_heads")
    assumed = ""
    if not args.global_batch:
        size = f"~{_tokens(default_batch_tokens(params))} tokens for {parameter_count(params)} parameters"
        assumed = (f"assumed global batch {batch} x {seq} = {_tokens(batch * seq)} tokens per step ({size}); "
                   "give --global-batch for yours")
    return Workload(m, batch, seq, optimizer=args.optimizer), assumed


def _raise_batch(w: Workload, gpus: int) -> tuple[Workload, dict]:
    """The assumed batch raised to one sequence per GPU (every layout's dp divides it), with the line saying so."""
    old, new = w.global_batch, gpus
    why = (f"no layout of {gpus} GPUs splits the assumed {old} sequences (dp x tp x pp must use every GPU, with tp "
           f"at most a node and pp at most the {w.model.layers} layers, and dp must divide the batch)")
    line = (f"global batch raised from {old} to {new} sequences ({_tokens(new * w.seq_len)} tokens per step, one per "
            f"GPU, {new / old:.3g}x the assumed batch): {why}; give --global-batch to plan another")
    return replace(w, global_batch=new), {"from": old, "to": new, "why": why, "line": line}


def parameter_count(n: int) -> str:
    """A parameter count in the unit that fits: 404k, 12.3M, 1.2B (never 0.000404B)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _tokens(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"


def _fixed(args) -> dict:
    fixed = {key: getattr(args, opt) for opt, key in FIXABLE.items() if getattr(args, opt) is not None}
    for key in ("dp", "tp", "pp", "ep", "microbatches", "virtual_stages", "cp", "max_cp"):
        if key in fixed and fixed[key] < 1:
            raise ConfigError("--" + key.replace("_", "-"), f"must be at least 1, got {fixed[key]}")
    if "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        raise ConfigError("--zero", f"unknown ZeRO stage {fixed['zero']}; choose 0, 1, 2 or 3")
    if fixed.get("cp") == 1 and "cp_method" in fixed:
        raise ConfigError("--cp-method", "has no effect at --cp 1 (no context parallelism); drop it or give --cp N > 1")
    layout = [fixed.get(k) for k in ("dp", "tp", "pp")]
    cp = fixed.get("cp", 1)
    if all(layout) and layout[0] * layout[1] * layout[2] * cp != args.gpus:
        names = "dp x cp x tp x pp" if cp > 1 else "dp x tp x pp"
        raise ConfigError("--gpus", f"{names} = {layout[0] * layout[1] * layout[2] * cp} but --gpus is {args.gpus}; "
                          "make the product equal the GPU count")
    if "virtual_stages" in fixed and fixed["virtual_stages"] > 1 and "schedule" not in fixed:
        fixed["schedule"] = pipeline_schedules.VIRTUAL_SCHEDULE
    return fixed


def run(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise ConfigError("--gpus", f"must be at least 1, got {args.gpus}")
    gpu = load_gpu(args.gpu)
    if args.network is not None:
        gpu = with_network(gpu, network(args.network))
    if args.inter_gbps is not None:
        if args.inter_gbps <= 0:
            raise ConfigError("--inter-gbps", f"must be positive, got {args.inter_gbps}")
        label = f"{args.inter_gbps:g} Gb/s" + (f" ({args.network} latency)" if args.network else "")
        gpu = replace(gpu, inter_bytes_per_s=args.inter_gbps / 8 * 1e9, infiniband=label)
    w, assumed = _workload(args)
    fixed = _fixed(args)
    refused = plan_refusal(w, fixed, args.precision)
    if refused is not None:
        raise ConfigError(*refused)
    explain = parse_layout(args.explain) if args.explain else None
    for value, flag in ((args.mtbf_hours, "--mtbf-hours"), (args.write_gbps, "--write-gbps"),
                        (args.host_gib, "--host-gib"), (args.nvme_gbps, "--nvme-gbps")):
        if value <= 0:
            raise ConfigError(flag, f"must be positive, got {value}")
    result = search(w, args.gpus, gpu, fixed, args.precision)
    raised = None
    if not result.candidates and not args.global_batch:  # the assumed batch, not the user's: raise it, and say so
        w, raised = _raise_batch(w, args.gpus)
        result = search(w, args.gpus, gpu, fixed, args.precision)
    if not result.candidates:  # an explicit layout that cannot exist: say why instead of an empty table
        problems = layout_problems(w, args.gpus, gpu, fixed) or [result.message]
        raise UserError(f"no layout of {args.gpus} GPUs matches the options: {'; '.join(problems)}")
    extra = {"assumed": assumed, "batch_raised": raised}
    muon = w.optimizer == "muon"  # no periodic sync, no offload with Muon (config/muon_checks.py)
    if result.feasible:
        extra["slow_links"] = None if muon else slow_link_advice(result)
        extra["checkpoint"] = checkpoint_advice(result.best, args.gpus, args.mtbf_hours, args.save_seconds,
                                                args.restart_seconds, args.write_gbps)
    else:
        extra["activation_offload"] = offload_advice(result)  # the only way to fit, if it is one
    no_offload = [] if result.feasible else ["offload: not with --optimizer muon (its states in host memory or files "
                                             "are not wired)"]
    offloaded, extra["offload"] = (None, no_offload) if muon else advise(result, args.host_gib, args.nvme_gbps)
    extra["offload_option"] = offloaded
    if result.candidates:
        extra["optimizer"] = optimizer_summary(w, result.candidates[0], args.precision)
    if explain is not None:
        extra["explain"] = _explain(w, args, gpu, {**fixed, **explain}, result)
    if args.precision == "fp8" and result.candidates:
        extra["fp8"] = fp8_advice(w, result.candidates[0].strategy, gpu)
    if args.precision == "mxfp8" and result.candidates:
        st = result.candidates[0].strategy
        extra["mxfp8"] = mx_advice(w.model, st.micro_batch_size(w) * st.local_seq(w), st.tp, gpu, st.label())
    scaling = scaling_points(w, gpu, args.precision, args.scaling_max) if args.scaling else None
    if args.json:
        print(json.dumps(to_json(result, scaling, extra), indent=1))
    else:
        print(render(result, args.top, extra))
        if scaling:
            print(render_scaling(scaling))
    if scaling:
        from .scaling import plot_scaling

        path = plot_scaling(scaling, args.scaling, f"{w.model.preset} on {gpu.name}, global batch {w.global_batch}")
        print(f"scaling plot: {path}", file=sys.stderr if args.json else sys.stdout)
    if not result.feasible and offloaded is None:
        raise UserError(result.message)
    return 0


def _explain(w: Workload, args, gpu, knobs: dict, result: PlanResult) -> dict:
    """The best member of the layout `knobs` and why it loses to the best plan."""
    r = search(w, args.gpus, gpu, knobs, args.precision)
    if not r.candidates:
        problems = layout_problems(w, args.gpus, gpu, knobs) or [r.message]
        return {"layout": args.explain, "candidate": None, "lines": [f"--explain {args.explain}: impossible: "
                                                                      + "; ".join(problems)]}
    c = r.candidates[0]
    if not c.fits:
        why = shortfall(c, gpu)
    elif result.feasible and result.best.tokens_per_s > c.tokens_per_s:
        why = slower(c, result.best)
    else:
        why = "this is the fastest layout that fits"
    lines = [f"explain {c.strategy.label()}: {why}", *breakdown(c, gpu)]
    return {"layout": args.explain, "candidate": c.as_dict(), "lines": lines}


# ------------------------------------------------------------------ output


def model_summary(w: Workload) -> dict:
    m = w.model
    out = {"preset": m.preset, "params": total_parameters(m), "layers": m.layers, "hidden": m.hidden,
           "heads": m.heads, "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
           "mlp": m.mlp, "position": m.position}
    if m.experts:
        out.update(experts=m.experts, experts_top_k=m.experts_top_k, active_params=active_parameters(m))
    return out


def to_json(r: PlanResult, scaling: list[dict] | None = None, extra: dict | None = None) -> dict:
    g, extra = r.gpu, extra or {}
    out = {
        "model": model_summary(r.workload),
        "gpu": {"name": g.name, "peak_flops": g.peak_flops, "memory_bytes": g.memory_bytes, "nvlink": g.nvlink,
                "infiniband": g.infiniband, "gpus_per_node": g.gpus_per_node,
                "network": _network_json(g)},
        "gpus": r.gpus,
        "workload": {"global_batch": r.workload.global_batch, "seq_len": r.workload.seq_len,
                     "tokens_per_step": r.workload.tokens, "assumed": extra.get("assumed", ""),
                     # additive: {from, to, why, line} when the assumed batch had to be raised, else null
                     "batch_raised": extra.get("batch_raised")},
        "feasible": r.feasible, "message": r.message, "evaluated": r.evaluated,
        "candidates": [c.as_dict() for c in r.candidates],
    }
    if "checkpoint" in extra:
        out["checkpoint"] = extra["checkpoint"][0].as_dict()
    if extra.get("slow_links") is not None:
        out["slow_links"] = extra["slow_links"].as_dict()
    if extra.get("activation_offload") is not None:
        out["activation_offload"] = extra["activation_offload"].as_dict()
    if extra.get("offload_option") is not None:
        out["offload"] = extra["offload_option"].as_dict()
    if "explain" in extra:
        out["explain"] = {k: v for k, v in extra["explain"].items() if k != "lines"}
    if "fp8" in extra:
        out["fp8"] = extra["fp8"]
    for key in ("mxfp8", "optimizer"):  # additive (docs/planner.md "JSON")
        if key in extra:
            out[key] = extra[key]
    if scaling is not None:
        out["scaling"] = scaling
    return out


def fp8_advice(w: Workload, st, gpu) -> dict:
    """Which of a block's linears the fp8 auto rule converts under the layout `st` (planner/compute.py
    fp8_gains: the same rule as a run's `precision.fp8_linears=auto`), with each one's modelled speedup."""
    from .compute import block_linear_shapes, fp8_gains, fp8_speedup

    rows = st.micro_batch_size(w) * st.local_seq(w)
    layers = {name: {"m": m, "k": k, "n": n, "speedup": round(fp8_speedup(m, k, n, gpu), 3),
                     "fp8": fp8_gains(m, k, n, gpu)}
              for name, (m, k, n) in block_linear_shapes(w.model, rows, st.tp).items()}
    gaining = [n for n, v in layers.items() if v["fp8"]]
    line = (f"fp8 ({st.label()}): {len(gaining)} of {len(layers)} block linears gain on {gpu.name}"
            + (f" ({', '.join(gaining)})" if gaining else "") + "; the first and last block and the head stay bf16"
            + ("" if gpu.fp8_flops else f" ({gpu.name} has no fp8 tensor cores)"))
    return {"layout": st.label(), "linears": layers, "gaining": gaining, "line": line}


def _network_json(g) -> dict:
    """The inter-node network of the plan: its name (None for a custom rate), per-GPU rate and latency."""
    net = network_of(g)
    return {"name": net.name if net else None, "kind": net.kind if net else None,
            "gbps_per_gpu": g.inter_bytes_per_s * 8 / 1e9, "latency_s": g.inter_latency_s,
            "source": net.source if net else ""}


def render(r: PlanResult, top: int = 10, extra: dict | None = None) -> str:
    w, g, extra = r.workload, r.gpu, extra or {}
    lines = [f"{w.model.preset}: {parameter_count(total_parameters(w.model))} parameters, global batch {w.global_batch} x "
             f"{w.seq_len} tokens, {r.gpus} x {g.name} ({g.memory_bytes / GiB:.0f} GiB, {g.nvlink}, "
             f"{network_label(g)}); {r.evaluated} strategies evaluated"]
    if extra.get("assumed"):
        lines.append(extra["assumed"])
    if extra.get("batch_raised"):
        lines.append(extra["batch_raised"]["line"])
    lines.append("")
    # a cp column only when a row shown has context parallelism (other tables stay as they were)
    with_cp = any(c.strategy.cp > 1 for c in r.candidates[:top])
    cp_head = f" {'cp':>13}" if with_cp else ""
    header = f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3}{cp_head} {'ep':>3} {'zero':>4} {'m':>5} {'ckpt':>9} {'schedule':>14} " \
             f"{'GiB/GPU':>8} {'fits':>4} {'step s':>8} {'tokens/s':>10} {'MFU':>5}"
    lines += [header, "-" * len(header)]
    for i, c in enumerate(r.candidates[:top], 1):
        st = c.strategy
        sched = st.schedule_label if st.pp > 1 else "-"
        step = f"{c.time.total_s:8.3g}" if c.time else f"{'-':>8}"
        cp = (f" {(f'{st.cp} ' + st.cp_method) if st.cp > 1 else '1':>13}") if with_cp else ""
        lines.append(f"{i:>3} {st.dp:>4} {st.tp:>3} {st.pp:>3}{cp} {st.ep:>3} {st.zero:>4} {st.microbatches:>5} {st.remat:>9} "
                     f"{sched:>14} {c.memory.total / GiB:>8.1f} {'yes' if c.fits else 'no':>4} {step} "
                     f"{c.tokens_per_s:>10,.0f} {c.mfu:>5.1%}")
    lines.append("")
    if r.feasible:
        best = r.candidates[0]
        lines.append(f"best: {best.strategy.label()} - {best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%}, "
                     f"{best.memory.total / GiB:.1f} of {g.memory_bytes / GiB:.0f} GiB")
        lines += breakdown(best, g)
        if best.strategy.cp > 1:  # the training keys that run this layout's context parallelism
            lines.append(f"  train with --cp {best.strategy.cp} --set {train_overrides(best.strategy)[1]}")
        if "checkpoint" in extra:
            lines.append(extra["checkpoint"][1])
        for key in ("fp8", "mxfp8", "optimizer"):
            if key in extra:
                lines.append(extra[key]["line"])
        if extra.get("slow_links") is not None:
            lines.append(extra["slow_links"].describe(best))
        lines.append("why the others lose:")
        for i, c in enumerate(r.candidates[1:top], 2):
            lines.append(f"  #{i} {c.strategy.label()}: {c.why}")
        rest = [c for c in r.candidates[top:] if not c.fits]
        if rest:
            lines.append(f"  ... and {len(rest)} more layouts that do not fit, e.g. {rest[-1].strategy.label()}: "
                         f"{rest[-1].why}")
    else:
        lines.append("no layout fits; the closest:")
        if extra.get("activation_offload") is not None:
            lines.append("  " + extra["activation_offload"].describe())
        for i, c in enumerate(r.candidates[:top], 1):
            lines.append(f"  #{i} {c.strategy.label()}: {c.why}")
    lines += extra.get("offload", [])
    if "explain" in extra:
        lines += ["", *extra["explain"]["lines"]]
    return "\n".join(lines)


def scaling_points(w: Workload, gpu, precision: str, largest: int = SCALING_GPUS[-1]) -> list[dict]:
    """Best predicted layout at each size of SCALING_GPUS up to `largest` (same global batch)."""
    points = []
    for n in (n for n in SCALING_GPUS if n <= largest):
        r = search(w, n, gpu, None, precision)
        if not r.feasible:
            points.append({"gpus": n, "fits": False})
            continue
        best = r.best
        points.append({"gpus": n, "fits": True, "tokens_per_s": best.tokens_per_s, "mfu": best.mfu,
                       "layout": best.strategy.label(), "step_time_s": best.time.total_s})
    first = next((p for p in points if p["fits"]), None)
    for p in points:
        if p["fits"]:
            p["efficiency"] = (p["tokens_per_s"] / p["gpus"]) / (first["tokens_per_s"] / first["gpus"])
    return points


def render_scaling(points: list[dict]) -> str:
    lines = ["", "scaling (same global batch):", f"{'GPUs':>6} {'tokens/s':>12} {'efficiency':>10} {'MFU':>6}  layout"]
    for p in points:
        if p["fits"]:
            lines.append(f"{p['gpus']:>6} {p['tokens_per_s']:>12,.0f} {p['efficiency']:>10.1%} {p['mfu']:>6.1%}  "
                         f"{p['layout']}")
        else:
            lines.append(f"{p['gpus']:>6} {'does not fit':>12}")
    return "\n".join(lines)
