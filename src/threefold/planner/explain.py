"""What `threefold plan` says beyond the table: one layout's breakdown (`--explain LAYOUT`), why an
explicit layout is impossible, and the checkpoint-interval advice.

A LAYOUT is the label the table prints, or any part of it: "dp=4 tp=4 pp=4 zero=1 m=256
ckpt=selective zb-h1" (keys dp, tp, pp, cp, cp_method, ep, zero, m, ckpt, every, schedule, v; a bare schedule name,
"interleavedx2" included; "sp" / "nosp" fix sequence parallelism on / off, "hpz" fixes ZeRO-3's hpZ on).
Knobs it leaves out are searched as usual.
"""

from __future__ import annotations

import re

from ..errors import ConfigError
from ..schedules import registry as pipeline_schedules
from .checkpoint_interval import Advice, advise
from .context_comm import METHODS as CP_METHODS, ulysses_splits
from .hardware import GiB, Gpu
from .search import Candidate, components
from .workload import Workload

KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "zero": "zero", "m": "microbatches",
        "microbatches": "microbatches",
        "v": "virtual_stages", "every": "remat_every", "ckpt": "remat", "schedule": "schedule",
        "cp": "cp", "cp_method": "cp_method"}
SCHEDULES = tuple(pipeline_schedules.SCHEDULES)  # the registry's names (schedules/registry.py)
VIRTUAL = pipeline_schedules.VIRTUAL_SCHEDULE  # the one that takes virtual stages (interleaved)
POLICIES = ("none", "selective", "full", "every-k")


def parse_layout(text: str) -> dict:
    """'dp=4 tp=2 ckpt=full zb-h1' -> knobs for search(fixed=...); ConfigError naming the bad token."""
    fixed: dict = {}
    for token in re.split(r"[\s,]+", text.strip()):
        if not token:
            continue
        if token in ("sp", "nosp"):
            fixed["sequence_parallel"] = token == "sp"
            continue
        if token == "hpz":
            fixed["hpz"] = True
            continue
        match = re.fullmatch(re.escape(VIRTUAL) + r"x(\d+)", token)  # "interleavedx2"
        if token in SCHEDULES or match:
            fixed["schedule"] = VIRTUAL if match else token
            if match:
                fixed["virtual_stages"] = int(match.group(1))
            continue
        key, _, value = token.partition("=")
        if key not in KEYS or not value:
            raise ConfigError("--explain", f"'{token}' is not a layout knob; write e.g. 'dp=4 tp=2 pp=2 zero=1 m=8 "
                              f"ckpt=selective 1f1b' (keys {', '.join(sorted(KEYS))})")
        name = KEYS[key]
        if name == "remat" and value not in POLICIES:
            raise ConfigError("--explain", f"ckpt={value}: choose one of {', '.join(POLICIES)}")
        if name == "schedule" and value not in SCHEDULES:
            raise ConfigError("--explain", f"schedule={value}: choose one of {', '.join(SCHEDULES)}")
        if name == "cp_method" and value not in CP_METHODS:
            raise ConfigError("--explain", f"cp_method={value}: choose one of {', '.join(CP_METHODS)}")
        if name not in ("remat", "schedule", "cp_method"):
            if not value.isdigit():
                raise ConfigError("--explain", f"{key}={value}: must be a whole number")
            value = int(value)
        fixed[name] = value
    return fixed


def breakdown(c: Candidate, gpu: Gpu) -> list[str]:
    """The step time and memory of one candidate, term by term."""
    t, mem = c.time, c.memory
    terms = [f"{name} {_s(v)}" for name, v in components(t).items() if v > 0]
    lines = [f"  step {_s(t.total_s)} = " + " + ".join(terms),
             f"  {c.tokens_per_s:,.0f} tokens/s, MFU {c.mfu:.1%}; pipeline makespan "
             f"{'simulated' if t.simulated else 'closed form'}"]
    parts = [("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer),
             ("activations", mem.activations), ("transient", mem.transient), ("buffers", mem.buffers),
             ("margin", mem.margin)]
    lines.append(f"  memory {mem.total / GiB:.1f} of {gpu.memory_bytes / GiB:.0f} GiB (pipeline rank {mem.stage}) = "
                 + " + ".join(f"{k} {v / GiB:.1f}" for k, v in parts if v > 0))
    st = c.strategy
    if st.zero == 3:
        over = f"dp x cp = {st.replicas}" if st.cp > 1 else f"dp={st.dp}"
        groups = f"parameters and gradients sharded over {over}" + (f" (routed experts over {st.expert_replicas})"
                                                                    if st.ep > 1 else "")
        if st.hpz:
            groups += (f"; hpZ secondary weights over the {c.hpz_group} dp ranks of a node "
                       f"({c.hpz_bytes / GiB:.2f} GiB, in optimizer), the backward all-gather on {gpu.nvlink}")
        lines.append(f"  ZeRO-3: {groups}")
    if st.cp > 1:
        lines.append(f"  context parallelism: cp={st.cp} cp_method={st.cp_method} (parallel.cp, parallel.cp_method): "
                     f"each sequence's {st.cp} zigzag parts on ranks {st.tp} apart, gradients reduced and ZeRO-sharded "
                     f"over dp x cp = {st.replicas}; attention communication {_s(t.cp_comm_s)} exposed"
                     + (f", {_s(t.cp_overlapped_s)} hidden behind the ring's block attention" if t.cp_overlapped_s else ""))
    if t.ep_overlapped_s > 0:
        lines.append(f"  expert-parallel all-to-all: {_s(t.ep_comm_s)} exposed, {_s(t.ep_overlapped_s)} hidden behind "
                     "the paired chunks' compute")
    if t.optimizer_newton_schulz_s or t.optimizer_exchange_bytes:  # a whole-matrix optimizer (planner/optimizer.py)
        lines.append(f"  optimizer update {_s(t.optimizer_s)} = Newton-Schulz {_s(t.optimizer_newton_schulz_s)} on the "
                     f"busiest of the dp x tp = {st.dp * st.tp} owners + matrix exchange {_s(t.optimizer_exchange_s)} "
                     f"({t.optimizer_exchange_bytes / 2**20:.3g} MiB a step over the stage's ranks) + the elementwise "
                     f"update {_s(t.optimizer_s - t.optimizer_newton_schulz_s - t.optimizer_exchange_s)}")
    return lines


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"


def layout_problems(w: Workload, gpus: int, gpu: Gpu, fixed: dict) -> list[str]:
    """Why no strategy matches the fixed knobs: each violated rule, with its numbers."""
    m, out = w.model, []
    tp, pp, dp = fixed.get("tp"), fixed.get("pp"), fixed.get("dp")
    if tp:
        if m.heads % tp or m.kv_heads % tp:
            out.append(f"tp={tp} does not divide the {m.heads} heads and {m.kv_heads} kv heads")
        if m.ffn_hidden % tp:
            out.append(f"tp={tp} does not divide the MLP width {m.ffn_hidden}")
        if tp > gpu.gpus_per_node:
            out.append(f"tp={tp} is more than the {gpu.gpus_per_node} GPUs of a node")
    ep = fixed.get("ep")
    if ep and ep > 1 and not m.experts:
        out.append(f"ep={ep} needs a mixture of experts (model.experts is 0)")
    elif ep and m.experts % ep:
        out.append(f"ep={ep} does not divide the {m.experts} experts")
    if ep and dp and dp % ep:
        out.append(f"ep={ep} does not divide dp={dp} (expert parallelism is carved out of dp)")
    if pp and pp > m.layers:
        out.append(f"pp={pp} is more than the {m.layers} layers")
    if fixed.get("hpz"):
        zero = fixed.get("zero")
        if zero is not None and zero != 3:
            out.append(f"hpz needs zero=3, not zero={zero}")
        elif dp and tp:
            inside = min(dp, gpu.gpus_per_node // tp)
            if inside >= dp:
                out.append(f"hpz needs dp={dp} to span more than one node ({gpu.gpus_per_node // tp} dp ranks a node)")
            elif inside < 2 or dp % inside:
                out.append(f"hpz needs 2 or more dp ranks on each node and dp={dp} a multiple of them "
                           f"({max(inside, 1)} a node with tp={tp})")
    cp, method = fixed.get("cp", 1), fixed.get("cp_method")
    if cp > 1:
        if w.seq_len % (2 * cp):
            out.append(f"cp={cp}: the sequence length {w.seq_len} is not a multiple of 2 x cp = {2 * cp} (the zigzag "
                       "chunks)")
        if method == "ulysses" and not ulysses_splits(m.heads, m.kv_heads, cp, tp or 1):
            over = f"cp={cp}" if not tp or tp == 1 else f"cp x tp = {cp * tp}"
            out.append(f"cp_method=ulysses: the {m.heads} heads and {m.kv_heads} kv heads are not both divisible by "
                       f"{over}")
        if m.experts and m.expert_capacity > 0:
            out.append(f"cp={cp} with an expert capacity ({m.expert_capacity:g}) is refused: under cp routing is "
                       "dropless (model.expert_capacity=0)")
        if fixed.get("hpz"):
            out.append(f"cp={cp} with hpz is not wired in training yet")
        if tp and pp and gpus % (tp * pp * cp):
            out.append(f"cp x tp x pp = {tp * pp * cp} does not divide {gpus} GPUs")
    if tp and pp and gpus % (tp * pp):
        out.append(f"tp x pp = {tp * pp} does not divide {gpus} GPUs")
    rest = tp * pp * cp if tp and pp else 0  # dp is what tp x pp (x cp) leave
    if (dp or (rest and gpus % rest == 0)) and w.global_batch % (dp or gpus // rest):
        out.append(f"dp={dp or gpus // rest} does not divide the global batch {w.global_batch}")
    micro = fixed.get("microbatches")
    if micro and (dp or (tp and pp)) and (dp or gpus // rest) and (w.global_batch // (dp or gpus // rest)) % micro:
        out.append(f"microbatches={micro} does not divide the {w.global_batch // (dp or gpus // rest)} "
                   "sequences of a data-parallel rank")
    if fixed.get("schedule") == VIRTUAL and pp and micro and micro % pp:
        out.append(f"{VIRTUAL} needs microbatches ({micro}) to be a multiple of pp ({pp})")
    if fixed.get("schedule") == VIRTUAL and pp and m.layers % (pp * fixed.get("virtual_stages", 2)):
        out.append(f"{VIRTUAL} needs pp x virtual stages ({pp} x {fixed.get('virtual_stages', 2)}) to divide the "
                   f"{m.layers} layers")
    return out


def checkpoint_advice(best: Candidate, gpus: int, mtbf_hours: float, save_s: float | None, restart_s: float,
                      write_gbps: float) -> tuple[Advice, str]:
    """Young/Daly advice for the chosen plan; the save cost is given or estimated from the bytes a rank
    writes (parameters and optimizer states) at `write_gbps` GB/s per GPU."""
    written = best.memory.params + best.memory.optimizer
    how = "given"
    if save_s is None:
        save_s = written / (write_gbps * 1e9)
        how = f"estimated: {written / GiB:.1f} GiB per GPU at {write_gbps:g} GB/s"
    advice = advise(save_s, mtbf_hours, gpus, restart_s, best.time.total_s)
    return advice, (f"checkpoints ({gpus} GPUs of MTBF {mtbf_hours:,.0f} h each, save {how}): "
                    f"{advice.describe()}")
