"""When the network between nodes is what limits a plan: periodic synchronisation and ZeRO++.

After the layout search (lossless by construction), each fitting family's best layout whose
data-parallel group crosses nodes is re-evaluated with the options of docs/local_sgd.md and
docs/zero.md (the cost model is planner/dp_comm.py, the memory planner/memory.py):
    ZeRO-3   hpZ; int8 weight all-gathers; int8 weights + int8 gradients; both with hpZ
    ZeRO-0   DiLoCo meeting every H = 4, 16 or 64 steps (outer parameters and momentum kept)
The fastest variant that fits is found; if it beats the plan by at least MIN_GAIN, the advice
names the least risky variant reaching 90% of that gain (the options are ordered by what the
literature reports about their effect on the loss), with the figures and the reported risk.
On a fast network the gain stays under MIN_GAIN and nothing is recommended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import comm
from .hardware import Gpu
from .memory import dp_per_node
from .search import Candidate, PlanResult, evaluate

MIN_GAIN = 0.10  # recommend only what is at least 10% faster than the lossless plan
SHARE_OF_GAIN = 0.9  # the least risky option within 90% of the best gain
PERIODS = (4, 16, 64)

HPZ_RISK = ("none to the loss (it changes only where the backward all-gather reads); memory: a secondary copy of "
            "the weights sharded over the node's dp ranks")
WEIGHT_RISK = ("small: block-quantized int8 weight all-gathers (a scale per 256 values, error bound in docs/zero.md); "
               "ZeRO++ (Wang et al. 2023) reports model convergence preserved with its quantized weights")
GRAD_RISK = ("small: gradients reduced as an int8 all-to-all and a local fp32 sum, each value quantized once (error "
             "bound in docs/zero.md); ZeRO++ reports that this averaging 'preserves accuracy despite communicating "
             "low precision data' (with int4 there)")
# (name, changes, risk), least risky first
ZERO3_OPTIONS = [
    ("hpz", dict(hpz=True), HPZ_RISK),
    ("int8 weights", dict(weight_comm="int8"), WEIGHT_RISK),
    ("int8 weights + hpz", dict(weight_comm="int8", hpz=True), f"{WEIGHT_RISK}; hpZ: {HPZ_RISK}"),
    ("int8 weights and gradients", dict(weight_comm="int8", grad_comm="int8"), f"{WEIGHT_RISK}; {GRAD_RISK}"),
    ("int8 weights and gradients + hpz", dict(weight_comm="int8", grad_comm="int8", hpz=True),
     f"{WEIGHT_RISK}; {GRAD_RISK}; hpZ: {HPZ_RISK}"),
]

def _periodic_risk(h: int, replicas: int) -> str:
    return (f"DiLoCo (Douillard et al. 2023): 'on 8 workers performs as well as fully synchronous optimization "
            f"while communicating 500 times less' (C4, H = 500); here {replicas} replicas meet every {h} steps: "
            "the loss gap grows with the number of replicas, and plain local SGD (no outer momentum) did worse "
            "in that paper; check the loss against a synchronous run (docs/local_sgd.md)")


@dataclass
class SlowLinkAdvice:
    option: str  # the recommended variant, or "" when none gains MIN_GAIN
    candidate: Candidate | None
    gain: float  # tokens/s over the plan's, minus 1
    best_gain: float  # of the fastest variant
    risk: str
    plan_exposed_s: float  # the plan's exposed data-parallel/ZeRO seconds per step

    def as_dict(self) -> dict:
        return {"option": self.option, "gain": self.gain, "best_gain": self.best_gain, "risk": self.risk,
                "plan_exposed_dp_s": self.plan_exposed_s,
                "candidate": self.candidate.as_dict() if self.candidate else None}

    def describe(self, plan: Candidate) -> str:
        t = plan.time
        head = (f"slow links: the plan's exposed data-parallel/ZeRO communication is {t.dp_exposed_s:.3g} s and its "
                f"pipeline communication {t.pp_comm_s:.3g} s of its {t.total_s:.3g} s step")
        if not self.option:
            return f"{head}; no slow-link option gains {MIN_GAIN:.0%} (best {self.best_gain:+.1%})"
        c = self.candidate
        return (f"{head}; over the inter-node link, {self.option} ({c.strategy.label()}) would be {self.gain:.1%} "
                f"faster ({c.tokens_per_s:,.0f} tokens/s, {c.memory.total / 2**30:.1f} GiB). Loss risk: {self.risk}")


def _crosses_nodes(c: Candidate, gpu: Gpu) -> bool:
    st = c.strategy
    if st.cp > 1:  # the gradients' group is dp x cp (one collective over dp+cp)
        return st.replicas > 1 and comm.axis_link(gpu, "replica", st.tp, st.dp, st.replicas, st.cp).name == gpu.infiniband
    return st.dp > 1 and comm.axis_link(gpu, "dp", st.tp, st.dp, st.dp).name == gpu.infiniband


def _variants(c: Candidate, gpu: Gpu) -> list[tuple[int, str, object, str]]:
    """(risk order: ZeRO-3 options, then DiLoCo by period; name, strategy, risk) of the options for `c`."""
    st = replace(c.strategy, hpz=False)  # the search may have chosen hpZ: each option says whether it has it
    if st.cp > 1 and st.zero != 3:  # periodic syncs under cp are refused by the config (docs/context.md)
        return []
    if st.zero == 3:  # hpZ needs 2 or more dp ranks per node and more than one node (the runtime refuses otherwise)
        hpz = 2 <= dp_per_node(st, gpu) < st.dp and st.cp == 1  # and no cp (refused with it)
        return [(order, name, replace(st, **changes), risk) for order, (name, changes, risk) in enumerate(ZERO3_OPTIONS)
                if hpz or not changes.get("hpz")]
    if st.zero == 0:
        return [(len(ZERO3_OPTIONS) + i, f"DiLoCo every {h} steps", replace(st, sync_every=h, outer="nesterov"),
                 _periodic_risk(h, st.dp)) for i, h in enumerate(PERIODS)]
    return []


def advise(result: PlanResult) -> SlowLinkAdvice | None:
    """The slow-link advice for a feasible plan (None when no family's dp group crosses nodes)."""
    if not result.feasible:
        return None
    w, gpu, plan = result.workload, result.gpu, result.best
    tried = []
    for c in (c for c in result.candidates if c.fits and _crosses_nodes(c, gpu)):
        for order, name, st, risk in _variants(c, gpu):
            v = evaluate(w, st, gpu)
            if v.fits:
                tried.append((order, name, v, risk))
    if not tried:
        return None
    gains = [(v.tokens_per_s / plan.tokens_per_s - 1, order, name, v, risk) for order, name, v, risk in tried]
    best_gain = max(g for g, *_ in gains)
    if best_gain < MIN_GAIN:
        return SlowLinkAdvice("", None, 0.0, best_gain, "", plan.time.dp_exposed_s)
    enough = [g for g in gains if g[0] >= SHARE_OF_GAIN * best_gain]
    gain, _, name, v, risk = min(enough, key=lambda g: (g[1], -g[0]))  # the least risky, then the fastest
    return SlowLinkAdvice(name, v, gain, best_gain, risk, plan.time.dp_exposed_s)
