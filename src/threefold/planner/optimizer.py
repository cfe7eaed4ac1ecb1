"""The optimizer in the plan (`threefold plan --optimizer NAME`): its states and its step.

States: the registry's (optim/registry.py `OptimizerEntry.bytes_per_param`, no table of its own): per
trainable parameter the fp32 states of its entry plus the fp32 master under 16-bit compute; under Muon
the hidden matrices' (momentum) and the rest's (its AdamW's) apart, as `OptimizerEntry.states` says.

The update (memory-bound, per local parameter over the HBM bandwidth): read the master and the fp32
gradient, read and write each state, write the master and the compute copy: 16 + 8 x states bytes
(AdamW's 32). Muon's hidden matrices instead pass over their pieces as optim/muon_step.py does: the
momentum's lerp (read M, G, write M), the Nesterov blend (read G, M, write U), the decay (read and write
W), the update (read W, O, write W) and the compute copy: 48 bytes per element.

Muon's whole-matrix work (optim/exchange.py, docs/zero.md "Muon"): the hidden matrices of a pipeline
stage, sorted by size (largest first, then name), the k-th owned by grid position k mod (dp tp), i.e.
(dp coordinate, tp coordinate) = divmod(k mod dp tp, tp); each is assembled on its owner, orthogonalised
there once and scattered back, in four all_to_all_v hops (A over dp, B over tp, B back, A back). Bytes per
matrix of N elements, fp32, tp boxes of N/tp, ZeRO's ranges even (docs/zero.md's table, summed over ranks):
    A, under ZeRO: 2 N (dp-1)/dp    A, plain dp: (dp-1) N (the scatter only)    B: 2 N (tp-1)/tp
A hop takes (n-1) latencies plus the busiest rank's larger side (sent or received) over the axis link;
ZeRO-1/2's real ranges are a bucket's cut, so there the bytes are those of even ranges.

Newton-Schulz (muon_step.py `newton_schulz`): X (m x n, m <= n: a tall matrix is transposed) is
normalised, then each of `train.muon_ns_steps` iterations computes A = X X^T (2 m^2 n FLOPs), A A
(2 m^3), (b A + c A A) X (2 m^2 n): 4 m^2 n + 2 m^3 FLOPs per iteration, fp32 matmuls on the TF32
tensor cores (`precision.tf32`, on by default: half the dense BF16 peak on A100, H100 and B200 alike,
their data sheets' dense TF32 figures), each GEMM shaped as compute.py prices a GEMM; between them
7 m^2 + 5 m n elements of elementwise work per iteration (b A, c A, their sum, a X, the sum) and 5 m n
around the loop (the norm, the division, Moonlight's scale), 4 bytes each over the HBM bandwidth.
The busiest owner's matrices set the time (the exchange is collective). The dispatch floor counts
3 + 8 k + 1 operators per orthogonalised matrix and 4 per matrix piece (the momentum, the blend, the decay,
the update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..config import ModelConfig, TrainConfig
from ..optim.registry import ENTRIES, entry
from . import comm
from .compute import quantization_efficiency
from .hardware import Gpu

ELT = 4  # Muon's exchange and Newton-Schulz run in fp32
TF32_SHARE = 0.5  # dense TF32 / dense BF16 tensor-core peak (A100 156 / 312, H100 SXM 494.5 / 989, B200 1.1 / 2.25 PF)
UPDATE_BYTES_BASE, UPDATE_BYTES_PER_STATE = 16, 8  # read master and grad, write master and copy; read + write a state
MUON_MATRIX_UPDATE_BYTES = 48  # muon_step.py's passes over a matrix piece (module text)
MUON_PIECE_OPS = 4  # lerp_, lerp (or clone), mul_, add_ per matrix piece (a Python loop, not foreach)


def ns_ops(steps: int) -> int:
    """Operators of one orthogonalisation: the norm, + eps, the division, 8 per iteration, the scale."""
    return 3 + 8 * steps + 1


def optimizers() -> list[str]:
    """Every optimizer the plan can price: the registry's."""
    return list(ENTRIES)


def train_section(optimizer: str) -> TrainConfig:
    """The train section the plan assumes for `optimizer`: the defaults (SGD's momentum, Muon's steps)."""
    return TrainConfig(optimizer=optimizer)


@lru_cache(maxsize=256)
def state_bytes_per_param(optimizer: str, precision: str, matrix: bool) -> int:
    """Optimizer bytes per trainable parameter (fp32 master included under 16-bit compute), from its entry."""
    return entry(optimizer).bytes_per_param(train_section(optimizer), precision, matrix)[2]


def update_bytes_per_param(optimizer: str, matrix: bool) -> int:
    """HBM bytes of the update per local parameter (module text)."""
    e = entry(optimizer)
    if e.whole_matrices and matrix:
        return MUON_MATRIX_UPDATE_BYTES
    return UPDATE_BYTES_BASE + UPDATE_BYTES_PER_STATE * len(e.states(train_section(optimizer), matrix))


# ------------------------------------------------------------------ hidden matrices and their owners


def hidden_matrices(m: ModelConfig, layers) -> list[tuple[str, tuple[int, int]]]:
    """The hidden 2-D weights of blocks `layers` as the reference decoder names and shapes them (what
    optim/muon.py `hidden_matrix` selects: q, k, v, o, the MLP's (gate,) up and down)."""
    h, aw, kv, f = m.hidden, m.attn_width, m.kv_heads * m.head_dim, m.ffn_hidden
    per = [("attn.q", (aw, h)), ("attn.k", (kv, h)), ("attn.v", (kv, h)), ("attn.o", (h, aw))]
    per += [("mlp.gate", (f, h))] if m.mlp == "swiglu" else []
    per += [("mlp.up", (f, h)), ("mlp.down", (h, f))]
    return [(f"blocks.{i}.{name}.weight", shape) for i in layers for name, shape in per]


def whole_matrices(optimizer: str) -> bool:
    """Whether the optimizer's update needs each hidden matrix whole (its entry says: Muon)."""
    return entry(optimizer).whole_matrices


@lru_cache(maxsize=4096)
def matrix_parameters(m: ModelConfig, layers: int, tp: int) -> float:
    """Hidden-matrix parameters one tp rank holds of `layers` blocks (each matrix split over tp)."""
    return layers * sum(math.prod(s) for _, s in hidden_matrices(m, [0])) / tp


def owners(matrices: list[tuple[str, tuple[int, int]]], dp: int, tp: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(dp, tp) coordinate -> the shapes of the matrices it orthogonalises (optim/exchange.py `_plan`)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {divmod(k, tp): [] for k in range(dp * tp)}
    order = sorted(matrices, key=lambda x: (-math.prod(x[1]), x[0]))
    for k, (_, shape) in enumerate(order):
        out[divmod(k % (dp * tp), tp)].append(shape)
    return out


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> float:
    """Matmul FLOPs of orthogonalising one matrix: per iteration 2 m^2 n + 2 m^3 + 2 m^2 n (module text)."""
    m, n = min(shape), max(shape)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def _tf32_gemm_seconds(rows: int, cols: int, k: int, gpu: Gpu) -> float:
    peak = gpu.peak_flops * TF32_SHARE * gpu.gemm_efficiency * quantization_efficiency(rows, cols, gpu.sms)
    return max(2.0 * rows * cols * k / peak, ELT * (rows * k + k * cols + rows * cols) / gpu.hbm_bytes_per_s)


def newton_schulz_seconds(shape: tuple[int, int], steps: int, gpu: Gpu) -> float:
    """Kernel seconds of orthogonalising one matrix on `gpu` (its GEMMs and elementwise passes, module text)."""
    m, n = min(shape), max(shape)
    gemms = _tf32_gemm_seconds(m, m, n, gpu) + _tf32_gemm_seconds(m, m, m, gpu) + _tf32_gemm_seconds(m, n, m, gpu)
    elementwise = steps * (7 * m * m + 5 * m * n) + 5 * m * n
    return steps * gemms + ELT * elementwise / gpu.hbm_bytes_per_s


def muon_transient_bytes(m: ModelConfig, layers, dp: int, tp: int, local_matrix: float) -> float:
    """What Muon's step holds beyond the states on the busiest owner (optim/muon_step.py, exchange.py): every
    piece's update U (the rank's `local_matrix` elements), its owned matrices whole and their results, and the
    largest one's Newton-Schulz working set at its peak (X, A and three m x m products, or X and three m x n
    ones: max(m n + 4 m^2, 4 m n + m^2) beside the normalised input), fp32."""
    shapes = max(owners(hidden_matrices(m, layers), dp, tp).values(), key=lambda s: sum(map(math.prod, s)), default=[])
    work = max((min(s) * max(s) + max(min(s) * max(s) + 4 * min(s) ** 2, 4 * min(s) * max(s) + min(s) ** 2)
                for s in shapes), default=0)
    return ELT * (local_matrix + 2 * sum(map(math.prod, shapes)) + work)


# ------------------------------------------------------------------ the exchange


@dataclass(frozen=True)
class Hop:
    axis: str  # "dp" or "tp"
    sent: dict[tuple[int, int], float]  # (dp, tp) coordinate -> elements it sends
    received: dict[tuple[int, int], float]

    @property
    def elements(self) -> float:
        return sum(self.sent.values())


def exchange_hops(matrices: list[tuple[str, tuple[int, int]]], dp: int, tp: int, zero: int) -> list[Hop]:
    """The four hops of one step over a stage's matrices (A gather, B gather, B scatter, A scatter):
    the elements each (dp, tp) rank sends and receives, ZeRO's ranges even."""
    ranks = [(d, t) for d in range(dp) for t in range(tp)]
    a_out, a_in, b_out, b_in, back_out, back_in = ({r: 0.0 for r in ranks} for _ in range(6))
    order = sorted(matrices, key=lambda x: (-math.prod(x[1]), x[0]))
    for k, (_, shape) in enumerate(order):
        od, ot = divmod(k % (dp * tp), tp)
        box = math.prod(shape) / tp
        for t in range(tp):
            if t != ot:  # B: each other box to the owner (and back)
                b_out[(od, t)] += box
                b_in[(od, ot)] += box
            for d in range(dp):
                if d == od:
                    continue
                if zero >= 1:  # A under ZeRO: every other rank's range of each box, gathered and scattered
                    a_out[(d, t)] += box / dp
                    a_in[(od, t)] += box / dp
                back = box / dp if zero >= 1 else box  # plain dp: the whole box to every other replica
                back_out[(od, t)] += back
                back_in[(d, t)] += back
    return [Hop("dp", a_out, a_in), Hop("tp", b_out, b_in), Hop("tp", b_in, b_out), Hop("dp", back_out, back_in)]


def exchange_bytes(matrices: list[tuple[str, tuple[int, int]]], dp: int, tp: int, zero: int) -> float:
    """Bytes the exchange sends per step, summed over a stage's ranks (what `Comm` counts)."""
    return ELT * sum(h.elements for h in exchange_hops(matrices, dp, tp, zero))


def _hop_seconds(hop: Hop, dp: int, tp: int, gpu: Gpu) -> float:
    n = dp if hop.axis == "dp" else tp
    busiest = max(max(hop.sent[r], hop.received[r]) for r in hop.sent)
    if n == 1 or busiest == 0:
        return 0.0
    link = comm.axis_link(gpu, hop.axis, tp, dp, n)
    return (n - 1) * link.latency_s + ELT * busiest / link.bytes_per_s


# ------------------------------------------------------------------ one step


@dataclass(frozen=True)
class OptimizerStep:
    update_s: float  # the elementwise update (memory-bound, or its dispatch floor)
    newton_schulz_s: float = 0.0  # Muon: the busiest owner's orthogonalisations
    exchange_s: float = 0.0  # Muon: the four hops
    exchange_bytes: float = 0.0  # Muon: bytes per step, summed over the stage's ranks
    ns_flops: float = 0.0  # Muon: the busiest owner's Newton-Schulz FLOPs per step
    owned: int = 0  # Muon: matrices the busiest owner orthogonalises

    @property
    def total_s(self) -> float:
        return self.update_s + self.newton_schulz_s + self.exchange_s


@lru_cache(maxsize=4096)
def optimizer_step(optimizer: str, m: ModelConfig, layers: tuple[int, ...], local: float, local_matrix: float,
                   dp: int, tp: int, zero: int, gpu: Gpu, base_ops: int) -> OptimizerStep:
    """One step's optimizer on a pipeline rank holding blocks `layers`: `local` trainable parameters of
    which `local_matrix` are pieces of hidden matrices (after ZeRO's sharding); `base_ops` the foreach
    update's and the clip's operators (planner/dispatch.py)."""
    e = entry(optimizer)
    if not e.whole_matrices:
        update = local * update_bytes_per_param(optimizer, False) / gpu.hbm_bytes_per_s
        return OptimizerStep(max(update, base_ops * gpu.op_overhead_s))
    steps = train_section(optimizer).muon_ns_steps
    matrices = hidden_matrices(m, layers)
    rest = local - local_matrix
    update = (rest * update_bytes_per_param(optimizer, False)
              + local_matrix * update_bytes_per_param(optimizer, True)) / gpu.hbm_bytes_per_s
    ops = base_ops + MUON_PIECE_OPS * len(matrices)
    owned = owners(matrices, dp, tp)
    per_owner = [(sum(newton_schulz_seconds(s, steps, gpu) for s in shapes), shapes) for shapes in owned.values()]
    kernels, shapes = max(per_owner, key=lambda x: x[0]) if per_owner else (0.0, [])
    ns = max(kernels, len(shapes) * ns_ops(steps) * gpu.op_overhead_s)
    hops = exchange_hops(matrices, dp, tp, zero)
    exchange = sum(_hop_seconds(h, dp, tp, gpu) for h in hops)
    flops = sum(newton_schulz_flops(s, steps) for s in shapes)
    return OptimizerStep(max(update, ops * gpu.op_overhead_s), ns, exchange, ELT * sum(h.elements for h in hops),
                         flops, len(shapes))


# ------------------------------------------------------------------ what the plan says


def plan_refusal(w, fixed: dict, precision: str) -> tuple[str, str] | None:
    """(flag, one line) where the run the plan describes would be refused (config/muon_checks.py,
    parallel/mxfp8.py `refusal`); the search itself never tries cp > 1 under Muon (search.py)."""
    from .mx import BLOCK, whole_blocks

    m = w.model
    if precision == "mxfp8" and fixed.get("tp", 1) > 1 and not whole_blocks(m, fixed["tp"]):
        return "--tp", (f"mxfp8 scales blocks of {BLOCK} features: tp={fixed['tp']} leaves a rank part of one (the "
                        f"attention width {m.attn_width}, the MLP's {m.ffn_hidden}); choose a tp that leaves multiples "
                        f"of {BLOCK}, or --precision fp8")
    if w.optimizer != "muon":
        return None
    from ..schedules.registry import SCHEDULES

    why = {"model.experts": (bool(m.experts), "expert weights are not assembled per expert yet; use a dense model"),
           "model.lora_rank": (m.lora_rank > 0, "LoRA adapters are not hidden matrices of the model; use adamw"),
           "--cp": (fixed.get("cp", 1) > 1, "the matrix exchange runs over dp and tp, not cp; drop --cp"),
           "--schedule": ("schedule" in fixed and not SCHEDULES[fixed["schedule"]].synchronous,
                          "a schedule updating weights without a flush keeps its own optimizer step")}
    for key, (refused, reason) in why.items():
        if refused:
            return key, f"--optimizer muon: {reason}"
    return None


def optimizer_summary(w, best, precision: str) -> dict:
    """The optimizer of the plan: its states and bytes per parameter (the registry's), and for Muon the
    best layout's Newton-Schulz work and exchange; with one line for the table."""
    e = entry(w.optimizer)
    cfg = train_section(w.optimizer)
    out = {"name": e.name, "summary": e.summary, "whole_matrices": e.whole_matrices,
           "states": {"matrix": list(e.states(cfg, True)), "rest": list(e.states(cfg, False))},
           "bytes_per_param": {"matrix": state_bytes_per_param(e.name, precision, True),
                               "rest": state_bytes_per_param(e.name, precision, False)},
           "update_bytes_per_param": {"matrix": update_bytes_per_param(e.name, True),
                                      "rest": update_bytes_per_param(e.name, False)}}
    b = out["bytes_per_param"]
    line = f"optimizer {e.name}: {b['rest']} bytes of states per parameter (fp32 master included under 16-bit compute)"
    if e.name == "sgd":
        line += f" at train.momentum={cfg.momentum:g} (the default)"
    if e.name == "onebit_adam":
        line += "; its 1-bit momentum exchange is not priced (the plan's data-parallel traffic is AdamW's)"
    if e.whole_matrices:
        matrices = hidden_matrices(w.model, range(w.model.layers))
        flops = sum(newton_schulz_flops(s, cfg.muon_ns_steps) for _, s in matrices)
        t = best.time
        out.update(ns_steps=cfg.muon_ns_steps, matrices=len(matrices), newton_schulz_flops_per_step=flops,
                   newton_schulz_s=t.optimizer_newton_schulz_s if t else None,
                   exchange_s=t.optimizer_exchange_s if t else None,
                   exchange_bytes_per_step=t.optimizer_exchange_bytes if t else None)
        line = (f"optimizer muon: hidden matrices {b['matrix']} bytes per parameter, the rest (AdamW) {b['rest']}; "
                f"{len(matrices)} matrices orthogonalised once each, {flops:.3g} FLOPs a step in all")
        if t:
            line += (f"; {best.strategy.label()}: Newton-Schulz {t.optimizer_newton_schulz_s * 1e3:.3g} ms on the "
                     f"busiest owner, exchange {t.optimizer_exchange_bytes / 2**20:.3g} MiB "
                     f"({t.optimizer_exchange_s * 1e3:.3g} ms)")
    out["line"] = line
    return out
