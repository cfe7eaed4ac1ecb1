"""Layout search: enumerate strategies, drop what does not fit, rank by predicted tokens/s.

The space: tp over divisors of the GPU count that fit in a node and divide the heads (and kv
heads, and the MLP width); pp over divisors of what is left, at most the layer count; dp the
rest, dividing the global batch; for a mixture of experts ep over the divisors of dp that divide
the expert count; context parallelism cp (`context_degrees`: at long sequences, divisors of what tp x pp
leave whose zigzag split the sequence allows, each attention method that can split the heads); ZeRO 0-3
at every dp, one replica included (ZeRO shards over the replicas dp x cp; at one it shards nothing, but
optimizer offload needs ZeRO >= 1); micro-batch sizes 1-16; activation
checkpointing none / selective / every-k (one block in two) / full - the fastest that fits wins,
so full recomputation is chosen only when nothing cheaper fits; with pp > 1 the schedules 1f1b, gpipe, zb-h1 and
interleaved (every depth v that divides the blocks per rank, `interleaving_depths`). Any knob fixed by
the caller is not searched.

Two knobs are settled per family after its best member is found (`_refine`), which keeps the search's
cost: sequence parallelism (tried on first whenever tp > 1, then off with each checkpointing policy;
it stays on only when it pays: needed to fit, or faster - its backward re-gather costs time) and
hpZ for ZeRO-3 (`hpz_group`: the secondary weight partition over the dp ranks of one node, the only
group the runtime builds, parallel/hpz.py; tried with each checkpointing policy, kept when faster
and fitting).

The answer names the best strategy and, for every other (layout, zero) family, its best
member with the reason it loses: memory short by how much, or slower by how much and where
the time goes (bubble, tensor-parallel or data-parallel communication, recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from ..layout import Layout
from ..schedules.registry import DEFAULT_SCHEDULE, SCHEDULES as KINDS
from .compute import mfu
from .context_comm import METHODS as CP_METHODS, ulysses_splits
from .hardware import GiB, Gpu
from .mx import whole_blocks
from .memory import MemoryBreakdown, dp_per_node, rank_memory, slow_link_state_bytes
from .step_time import StepTime, step_time
from .workload import Strategy, Workload, rank_parameters, total_parameters

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
REMAT_POLICIES = ("none", "selective", "every-k", "full")  # cheapest first; every-k checkpoints one block in 2
# every synchronous schedule of the registry (schedules/registry.py); an asynchronous one changes the
# optimisation and is never chosen for the user
SEARCHED = tuple(sorted((name for name, kind in KINDS.items() if kind.synchronous),
                        key=lambda n: KINDS[n].preference))  # ties go to the simpler (the registration's preference)


@dataclass
class Candidate:
    strategy: Strategy
    memory: MemoryBreakdown
    fits: bool
    time: StepTime | None = None
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    why: str = ""
    hpz_group: int = 0  # with hpZ: the dp ranks of a node that shard the secondary weight copy
    hpz_bytes: float = 0.0  # that copy's bytes on the rank (counted in the "optimizer" memory)

    def as_dict(self) -> dict:
        st = self.strategy
        mem = self.memory.as_dict()
        return {
            "dp": st.dp, "tp": st.tp, "pp": st.pp, "ep": st.ep, "zero": st.zero, "microbatches": st.microbatches,
            "activation_checkpointing": st.remat, "schedule": st.schedule if st.pp > 1 else None,
            "virtual_stages": st.virtual_stages, "sequence_parallel": st.sequence_parallel,
            "precision": st.precision,
            "memory_bytes": {k: mem[k] for k in ("params", "grads", "optimizer", "activations", "transient",
                                                 "buffers", "margin", "total")},
            "fits": self.fits,
            "step_time_s": self.time.total_s if self.time else None,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "step_breakdown_s": self.time.as_dict() if self.time else None,
            "why": self.why,
            # ZeRO-3's shard groups (additive): parameters and gradients over dp (edp for routed experts);
            # with hpZ a secondary copy of the weights over `hpz_group` dp ranks of one node
            "hpz": st.hpz, "hpz_group": self.hpz_group or None, "hpz_secondary_bytes": int(round(self.hpz_bytes)),
            # context parallelism (only when cp > 1: other layouts keep the keys they always had), with the
            # training keys that run it
            **({"cp": st.cp, "cp_method": st.cp_method, "train_overrides": train_overrides(st)} if st.cp > 1 else {}),
        }


def train_overrides(st: Strategy) -> list[str]:
    """The `threefold train --set` keys of a layout's context parallelism (config/sections.py)."""
    return [f"parallel.cp={st.cp}", f"parallel.cp_method={st.cp_method}"] if st.cp > 1 else []


@dataclass
class PlanResult:
    workload: Workload
    gpu: Gpu
    gpus: int
    candidates: list[Candidate]  # best first: fitting by tokens/s, then the rest by memory
    evaluated: int
    feasible: bool
    message: str = ""
    extra: dict = field(default_factory=dict)
    priced: int = 0  # strategies whose step time was computed in full (`evaluated` counts the space enumerated)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.feasible else None


# ------------------------------------------------------------------ the space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MAX_INTERLEAVING_DEPTHS = 6  # the deepest this many of them, to bound the search


def interleaving_depths(layers: int, pp: int) -> list[int]:
    """Virtual stages per rank the search tries: every v >= 2 that divides the blocks per rank (either
    rounding when pp does not divide the layers), the deepest MAX_INTERLEAVING_DEPTHS. Real runs use
    5-23 (Megatron-LM's 530B and 1T, Llama 3 405B), not only 2."""
    per_rank = {layers // pp, -(-layers // pp)}
    depths = sorted(v for v in range(2, layers // pp + 1) if any(n % v == 0 for n in per_rank) and pp * v <= layers)
    return depths[-MAX_INTERLEAVING_DEPTHS:]


def enumerate_strategies(w: Workload, gpus: int, gpu: Gpu, fixed: dict | None = None,
                         precision: str = "bf16") -> list[Strategy]:
    """Every strategy of the space for `gpus` GPUs; `fixed` pins knobs (dp, tp, pp, ep, zero,
    microbatches, remat, schedule, virtual_stages, sequence_parallel, hpz, bucket_mb). ep (a mixture of experts only)
    runs over the divisors of dp that divide the expert count. Sequence parallelism starts on when
    tp > 1 and hpZ off (`search` settles both per family); a fixed `hpz` keeps only the ZeRO-3
    layouts whose dp groups the runtime can give a node-local partition (`hpz_group`)."""
    fixed = fixed or {}
    m = w.model
    out = []
    tps = [t for t in _divisors(gpus) if t <= gpu.gpus_per_node and m.heads % t == 0 and m.kv_heads % t == 0
           and m.ffn_hidden % t == 0 and (precision != "mxfp8" or whole_blocks(m, t))]  # mxfp8: planner/mx.py
    for tp in tps if "tp" not in fixed else [t for t in tps if t == fixed["tp"]]:
        if gpus % tp:
            continue
        pps = [p for p in _divisors(gpus // tp) if p <= m.layers]
        for pp, cp in ((p, c) for p in (pps if "pp" not in fixed else [fixed["pp"]]) if (gpus // tp) % p == 0
                       for c in context_degrees(w, gpus // (tp * p), tp, fixed)):
            dp = gpus // (tp * pp * cp)
            if "dp" in fixed and fixed["dp"] != dp or w.global_batch % dp:
                continue
            per_rank = w.global_batch // dp
            # every stage at every dp, one replica included: sharding over one rank saves nothing, but ZeRO >= 1
            # is what optimizer offload needs (config/checks.py), and offload may be the only way to fit
            zeros = fixed["zero"] if "zero" in fixed else range(4)
            eps = [e for e in _divisors(dp) if m.experts and m.experts % e == 0] or [1]
            eps = [e for e in eps if e == fixed["ep"]] if "ep" in fixed else eps
            methods = context_methods(m, tp, cp, fixed)
            for zero, ep, cp_method in product([zeros] if isinstance(zeros, int) else zeros, eps, methods):
                layout = Layout(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
                hpz = fixed.get("hpz", False)
                if hpz and not hpz_group(Strategy.of(layout, zero=zero), gpu):
                    continue
                if "microbatches" in fixed:
                    mbs = [fixed["microbatches"]] if per_rank % fixed["microbatches"] == 0 else []
                else:
                    mbs = [per_rank // b for b in MICRO_BATCH_SIZES if per_rank % b == 0]
                remats = [fixed["remat"]] if "remat" in fixed else REMAT_POLICIES
                schedules = ([fixed["schedule"]] if "schedule" in fixed
                             else SEARCHED if pp > 1 else (DEFAULT_SCHEDULE,))
                for micro, remat, schedule in product(mbs, remats, schedules):
                    vs = [1]
                    if KINDS[schedule].needs_virtual_stages:
                        vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else interleaving_depths(m.layers, pp)
                        if micro % pp:
                            continue
                    for v in vs:
                        if KINDS[schedule].needs_virtual_stages and (v < 2 or pp * v > m.layers):
                            continue
                        if pp > 1 and (KINDS[schedule].check(pp, micro, v)
                                       or pp * KINDS[schedule].chunks_for(v) > m.layers):
                            continue
                        out.append(Strategy.of(layout, zero=zero, microbatches=micro, remat=remat,
                                               schedule=schedule, virtual_stages=v,
                                               sequence_parallel=fixed.get("sequence_parallel", tp > 1),
                                               precision=precision, remat_every=fixed.get("remat_every", 2),
                                               hpz=hpz, bucket_mb=fixed.get("bucket_mb", Strategy.bucket_mb),
                                               **({"cp_method": cp_method} if cp > 1 else {})))
    return out


# Context parallelism is searched only where it can matter: sequences of CP_MIN_SEQ_LEN tokens or more
# (the published runs that use it train 16k-1M tokens; below, a sequence's activations are rarely what
# does not fit), and each rank keeping at least CP_MIN_LOCAL_SEQ tokens of it (the ring's hop hides behind
# attention that shrinks as the local part squared; allgather's and ulysses' bytes per attention FLOP grow as
# the local part shrinks). A cp the caller fixes (--cp) is evaluated at any length; --max-cp bounds the search.
CP_MIN_SEQ_LEN = 16384
CP_MIN_LOCAL_SEQ = 4096


def context_degrees(w: Workload, rest: int, tp: int, fixed: dict) -> list[int]:
    """The cp values to try with `rest` GPUs left for dp x cp: 1, and each divisor of `rest` whose zigzag
    split the sequence allows (seq_len a multiple of 2 cp), for the layouts the config lets cp run
    (`context_allowed`: config/checks.py `_validate_context`)."""
    if "cp" in fixed:
        cp = fixed["cp"]
        return [cp] if rest % cp == 0 and (cp == 1 or context_allowed(w, fixed) and w.seq_len % (2 * cp) == 0) else []
    if w.seq_len < CP_MIN_SEQ_LEN or not context_allowed(w, fixed):
        return [1]
    bound = fixed.get("max_cp", rest)
    return [c for c in _divisors(rest) if c == 1 or (c <= bound and w.seq_len % (2 * c) == 0
                                                       and w.seq_len // c >= CP_MIN_LOCAL_SEQ)]


def context_allowed(w: Workload, fixed: dict) -> bool:
    """Whether cp > 1 can run with this workload and these fixed knobs (the config's refusals): no hpZ,
    and a mixture of experts routed dropless (threefold's decoder and the Hugging Face families threefold
    builds all have the attention seam; their mixtures of experts route each rank's part of the sequence)."""
    m = w.model
    if m.experts and m.expert_capacity > 0:  # capacity is a matter of positions: refused under cp
        return False
    if w.optimizer == "muon":  # its matrix exchange runs over dp and tp, not cp (config/muon_checks.py)
        return False
    return not fixed.get("hpz", False)


def context_methods(m, tp: int, cp: int, fixed: dict) -> list[str]:
    """The attention methods of a cp layout: every one (ulysses only when cp x tp divides the heads and kv
    heads), or the one fixed; one placeholder at cp = 1."""
    if cp == 1:
        return ["ring"]
    methods = [fixed["cp_method"]] if "cp_method" in fixed else list(CP_METHODS)
    return [x for x in methods if x != "ulysses" or ulysses_splits(m.heads, m.kv_heads, cp, tp)]


def hpz_group(st: Strategy, gpu: Gpu) -> int:
    """The group hpZ's secondary partition is sharded over: the dp ranks of one node, as the runtime
    builds it (parallel/hpz.py, `dp_intra`); 0 where the runtime refuses hpZ (not ZeRO-3, every dp rank
    in one node, one dp rank per node, or dp groups that do not split evenly over nodes)."""
    inside = dp_per_node(st, gpu)
    ok = (st.zero == 3 and 2 <= inside < st.dp and st.dp % inside == 0 and gpu.gpus_per_node % st.tp == 0
          and st.cp == 1)  # hpZ with cp is refused (docs/context.md)
    return inside if ok else 0


def _hpz_bytes(w: Workload, st: Strategy, gpu: Gpu, stage: int) -> float:
    if not st.hpz or st.zero < 3:
        return 0.0
    count = rank_parameters(w.model, st.tp, st.pp, stage, st.chunks, st.ep, st.placement)
    return slow_link_state_bytes(count, replace(st, sync_every=1), dp_per_node(st, gpu))


def evaluate(w: Workload, st: Strategy, gpu: Gpu, mem: MemoryBreakdown | None = None,
             beat: Candidate | None = None) -> Candidate | None:
    """A strategy priced: its memory (`mem` when the caller has it already) and its step time. With `beat`
    (a fitting candidate), None when the strategy provably cannot be faster (step_time's bound)."""
    mem = mem or rank_memory(w, st, gpu)
    t = step_time(w, st, gpu, beat.time.total_s if beat is not None else None)
    if t is None:
        return None
    return Candidate(st, mem, mem.total <= gpu.memory_bytes, t, w.tokens / t.total_s,
                     mfu(w, t.total_s, st.world_size, gpu.flops(st.precision)),
                     hpz_group=hpz_group(st, gpu) if st.hpz else 0, hpz_bytes=_hpz_bytes(w, st, gpu, mem.stage))


# ------------------------------------------------------------------ explanations


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.1 else f"{s * 1e3:.3g} ms"


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def shortfall(c: Candidate, gpu: Gpu) -> str:
    mem = c.memory
    return (f"does not fit: needs {_gib(mem.total)} per GPU, {_gib(mem.total - gpu.memory_bytes)} more than the "
            f"{_gib(gpu.memory_bytes)} of a {gpu.name} (model states {_gib(mem.model_states)}, activations "
            f"{_gib(mem.activations)}, buffers/transients/margin {_gib(mem.transient + mem.buffers + mem.margin)})")


def components(t: StepTime) -> dict[str, float]:
    """The step time split into the terms of the "why" column (they add up to the step time)."""
    compute = t.pipeline_s - t.bubble_s - t.tp_comm_s - t.recompute_s - t.pp_comm_s - t.ep_comm_s - t.cp_comm_s
    return {"compute": compute, "recomputation": t.recompute_s, "pipeline bubble": t.bubble_s,
            "tensor-parallel communication": t.tp_comm_s, "pipeline communication": t.pp_comm_s,
            "expert-parallel all-to-all": t.ep_comm_s, "context-parallel attention communication": t.cp_comm_s,
            "exposed data-parallel/ZeRO communication": t.dp_exposed_s,
            "compute slowed by overlapped collectives": t.overlap_slowdown_s, "optimizer update": t.optimizer_s}


NEGLIGIBLE = 0.005  # terms under 0.5% of the step are left out of the "why" column


def slower(c: Candidate, best: Candidate) -> str:
    a, b = components(c.time), components(best.time)
    deltas = sorted(((a[k] - b[k], k) for k in a), reverse=True)
    floor = NEGLIGIBLE * best.time.total_s
    worst = ", ".join(f"{k} +{_seconds(d)}" for d, k in deltas[:2] if d > floor)
    pct = c.time.total_s / best.time.total_s - 1
    return (f"{pct:.1%} slower ({c.time.total_s:.3g} s vs {best.time.total_s:.3g} s per step, "
            f"{c.tokens_per_s:,.0f} vs {best.tokens_per_s:,.0f} tokens/s): {worst or 'about equal'}")


# ------------------------------------------------------------------ the search


def search(w: Workload, gpus: int, gpu: Gpu, fixed: dict | None = None, precision: str = "bf16") -> PlanResult:
    strategies = enumerate_strategies(w, gpus, gpu, fixed, precision)
    if not strategies:
        return PlanResult(w, gpu, gpus, [], 0, False, _no_layout_message(w, gpus, gpu, fixed))
    families: dict[tuple, Candidate] = {}
    priced = 0  # strategies whose step time was computed in full (the others fit not, or provably lose)
    for st in strategies:
        mem = rank_memory(w, st, gpu)
        fits = mem.total <= gpu.memory_bytes
        key = (Layout.of(st), st.zero)
        held = families.get(key)
        if not fits:  # keep the smallest non-fitting member until a fitting one shows up
            if held is None or (not held.fits and mem.total < held.memory.total):
                families[key] = Candidate(st, mem, False)
            continue
        c = evaluate(w, st, gpu, mem, held if held is not None and held.fits else None)
        priced += c is not None
        if c is not None and (held is None or not held.fits or c.tokens_per_s > held.tokens_per_s):
            families[key] = c
    for key, c in families.items():
        if c.fits:
            families[key], n = _refine(w, c, gpu, fixed or {})
            priced += n
    ranked = sorted(families.values(), key=lambda c: (not c.fits, -c.tokens_per_s if c.fits else c.memory.total))
    for i, c in enumerate(ranked):
        if c.time is None:
            ranked[i] = c = replace(evaluate(w, c.strategy, gpu), fits=False)
    feasible = ranked[0].fits
    best = ranked[0]
    for c in ranked:
        if not c.fits:
            c.why = shortfall(c, gpu)
        elif c is best:
            c.why = "fastest layout that fits"
        else:
            c.why = slower(c, best)
    message = "" if feasible else nothing_fits_message(w, gpus, gpu, best, precision, constrained=bool(fixed))
    return PlanResult(w, gpu, gpus, ranked, len(strategies), feasible, message, priced=priced)


def _refine(w: Workload, best: Candidate, gpu: Gpu, fixed: dict) -> tuple[Candidate, int]:
    """A family's best member with sequence parallelism off and with hpZ on (each knob the caller left
    open), at every checkpointing policy it allows: the fastest that fits wins, the member itself on a
    tie (SP then stays on only when it is needed to fit or is faster); with the count of variants priced."""
    st = best.strategy
    remats = [fixed["remat"]] if "remat" in fixed else REMAT_POLICIES
    variants = []
    if st.tp > 1 and st.sequence_parallel and "sequence_parallel" not in fixed:
        variants += [dict(sequence_parallel=False, remat=r) for r in remats]
    if not st.hpz and "hpz" not in fixed and hpz_group(st, gpu):
        variants += [dict(hpz=True, remat=r) for r in remats]
        variants += [dict(hpz=True, sequence_parallel=False, remat=r) for r in remats
                     if st.tp > 1 and st.sequence_parallel and "sequence_parallel" not in fixed]
    priced = 0
    for changes in variants:
        v = replace(st, **changes)
        if v == st:
            continue
        mem = rank_memory(w, v, gpu)
        if mem.total > gpu.memory_bytes:
            continue
        c = evaluate(w, v, gpu, mem, best)
        priced += c is not None
        if c is not None and c.tokens_per_s > best.tokens_per_s * (1 + 1e-9):
            best = c
    return best, priced


def _no_layout_message(w: Workload, gpus: int, gpu: Gpu, fixed: dict | None) -> str:
    return (f"no layout of {gpus} GPUs matches the constraints {fixed or {}} for {w.model.preset} with global batch "
            f"{w.global_batch}: dp x {'cp x ' if fixed and fixed.get('cp', 1) > 1 else ''}tp x pp must equal {gpus}, tp must divide the heads ({w.model.heads}) and kv heads "
            f"({w.model.kv_heads}) and be at most {gpu.gpus_per_node}, pp at most the layers ({w.model.layers}), and dp "
            "must divide the global batch")


def min_gpus_to_fit(w: Workload, gpu: Gpu, start: int, precision: str = "bf16", limit: int = 1 << 20) -> int | None:
    """The smallest power-of-two multiple of `start` GPUs on which some strategy fits."""
    n = start * 2
    while n <= limit:
        batch = max(w.global_batch, n)  # more GPUs need a batch they can divide
        wn = replace(w, global_batch=batch - batch % n if batch % n else batch)
        for st in enumerate_strategies(wn, n, gpu, {"remat": "full", "zero": 3} if n > 1 else {"remat": "full"},
                                       precision):
            if rank_memory(wn, st, gpu).total <= gpu.memory_bytes:
                return n
        n *= 2
    return None


def nothing_fits_message(w: Workload, gpus: int, gpu: Gpu, closest: Candidate, precision: str,
                         constrained: bool = False) -> str:
    params = total_parameters(w.model)
    if constrained:
        return (f"{w.model.preset} ({params / 1e9:.1f}B parameters) does not fit the requested layout on {gpus} x "
                f"{gpu.name}: the smallest variant ({closest.strategy.label()}) needs {_gib(closest.memory.total)} per "
                f"GPU of {_gib(gpu.memory_bytes)}, short by {_gib(closest.memory.total - gpu.memory_bytes)}; drop some "
                "layout options to let the planner search")
    need = min_gpus_to_fit(w, gpu, gpus, precision)
    more = f"; at least {need} {gpu.name} GPUs are needed" if need else ""
    return (f"{w.model.preset} ({params / 1e9:.1f}B parameters) fits no layout of {gpus} x {gpu.name}: the smallest "
            f"({closest.strategy.label()}) needs {_gib(closest.memory.total)} per GPU of {_gib(gpu.memory_bytes)}, "
            f"short by {_gib(closest.memory.total - gpu.memory_bytes)} (model states alone "
            f"{_gib(closest.memory.model_states)}){more}")
