"""A sparse mixture-of-experts MLP for the reference decoder (Switch, Mixtral, DeepSeek shapes).

    blocks.<i>.mlp.router            Linear(hidden -> experts), no bias: the router's logits
    blocks.<i>.mlp.experts.w_gate    (experts, expert_ffn_hidden, hidden)  SwiGLU only
    blocks.<i>.mlp.experts.w_up      (experts, expert_ffn_hidden, hidden)
    blocks.<i>.mlp.experts.w_down    (experts, hidden, expert_ffn_hidden)
    blocks.<i>.mlp.shared            a dense MLP of shared_experts x expert_ffn_hidden every token uses

The experts' weights are stacked along a leading expert dimension, so expert parallelism is a
split of that dimension (a box of the placement contract) and checkpoints reshard across ep
like any other split.

Routing, per token: softmax over the router's logits (fp32), the top `experts_top_k`
experts, their probabilities renormalised to sum to one when k > 1 (Mixtral; with k = 1 the
probability itself scales the output, as in Switch, so the router learns from the loss).
Capacity (`expert_capacity` = factor c > 0) is per *sequence*: an expert takes at most
ceil(c * seq * k / experts) of a sequence's assignments, first choices before second ones,
earlier positions first; the rest are dropped (the residual carries those tokens). c = 0 is
dropless: every expert takes every token routed to it (variable-size expert batches).
Because both the capacity and the load-balancing loss are per sequence, neither depends on
how a batch is split over ranks and micro-batches: every layout routes and drops alike.

Auxiliary losses, added to the summed token loss (so the trainer's division by the global
token count makes them means): the load-balancing loss E * sum_e f_e P_e of each sequence
(f_e the fraction of its assignments routed to e, P_e its mean router probability; Switch
Transformer, computed per sequence as DeepSeek-V3's sequence-wise balance loss) weighted by
`router_aux_weight`, and the router z-loss logsumexp(logits)^2 per token (ST-MoE) weighted by
`router_z_weight`. Without autograd (evaluation) they are not added: a validation loss is the
cross-entropy alone.

Balancing (`router_balance`): "aux" is the load-balancing loss above; "bias" is DeepSeek-V3's
auxiliary-loss-free rule - a float32 buffer `expert_bias` (E,) added to the probabilities for the
top-k choice only (the gate weights stay the unbiased probabilities, renormalised over k as above),
moved after each step by `update_bias` with the step's load summed over every rank
(parallel/expert.py's `router_metrics`), its balance loss the same per-sequence formula weighted by
`router_seq_aux_weight` (DeepSeek-V3's sequence-wise loss over the biased choice).

A rank's experts run as one batched matmul per weight (`Experts.forward`: `torch._grouped_mm` where
a capability test passes, else a padded `torch.bmm` when padding at most doubles the rows, else a
matmul per expert; `expert_kernel` states the rule).

How the routed rows reach the experts is the `dispatch` (an `ExpertDispatch`): here all
experts are local; expert parallelism (parallel/expert.py) replaces it with all-to-all.
Under sequence parallelism a block holds only its part of every sequence and routes those
tokens; `sequence` (a `SequenceShards`, set by parallel/expert.py) sums the per-sequence
statistics over the parts, so capacity, dropping and the auxiliary losses stay those of
whole sequences.

The tally for the metrics stays on the device (no host read); the router's forwards that are
not a training step's own (models/forwards.py: activation checkpointing's recomputation, a
pipelined evaluation) are not tallied. The only host read of a forward is the expert batch
sizes of the variable-size (dropless or dropping) dispatch, plus the kept positions when
tokens can drop.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .forwards import is_evaluating, is_recomputing


class ExpertDispatch(Protocol):
    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: "Experts") -> torch.Tensor:
        """Expert outputs of `rows` (A, h), sorted by global expert id with `counts` (experts,) rows
        each; the result has the rows' order."""


class SequenceShards(Protocol):
    """The ranks holding the other parts of every sequence, when a block sees only its own part:
    sequence parallelism (rank `rank` of `size` holds positions [rank s, (rank + 1) s)), context
    parallelism (zigzag chunks; dropless routing only, as capacity is a matter of positions) or both
    (each cp rank's zigzag part split over its tp ranks: `size` = cp x tp holders, dropless).
    `reports`: this holder's auxiliary loss value and tally count - every tp rank's under sequence
    parallelism (the loss is not summed over tp), the first cp rank's only under context parallelism
    (the loss is summed over cp); the others' auxiliary loss has value 0 and the gradient of their part."""

    rank: int
    size: int
    reports: bool

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the holders (forward); the gradient passes through unchanged (backward)."""

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(size, *t.shape): every holder's `t`, in order (no gradient)."""


class LocalDispatch:
    """Every expert on this device."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: "Experts") -> torch.Tensor:
        return experts(rows, counts.tolist())  # variable-size expert batches: their sizes on the host


def _matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight.t()


@functools.lru_cache(maxsize=None)
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs, forward and backward, on `device` in `dtype`: a capability
    test (one call on a few rows), never assumed. Asked on CUDA only (Hopper and later: bf16)."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([8, 16], device=device, dtype=torch.int32)).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def expert_kernel(rows: torch.Tensor, counts: list[int], hidden: int, width: int) -> str:
    """How `Experts` computes its experts (`kernel="auto"`): "grouped" (one `torch._grouped_mm` per
    weight, no padding) where the capability test passes and the rows are 16-byte aligned; else
    "padded" (one `torch.bmm` per weight over the experts' rows padded to the largest count) when the
    padded rows are at most twice the real ones (max count x experts <= 2 x rows), so a skewed routing
    never costs more than twice the rows' memory; else "loop" (a matmul per expert)."""
    aligned = (hidden * rows.element_size()) % 16 == 0 and (width * rows.element_size()) % 16 == 0
    if aligned and _grouped_mm_runs(rows.device, rows.dtype):
        return "grouped"
    return "padded" if max(counts, default=0) * len(counts) <= 2 * sum(counts) else "loop"


class Experts(nn.Module):
    """The stacked expert MLPs (this device's experts: all of them, or a contiguous run under ep)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, f, h = cfg.experts, cfg.expert_width, cfg.hidden
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.w_gate = nn.Parameter(torch.empty(e, f, h))
        self.w_up = nn.Parameter(torch.empty(e, f, h))
        self.w_down = nn.Parameter(torch.empty(e, h, f))
        # the experts' matmul y = x W^T (+ b), another one where set (fp8: parallel/fp8.py); None: x @ W^T
        self.linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        self.kernel = "auto"  # how the experts run: auto, grouped, padded or loop (`forward`)
        self.last_kernel = ""  # the kernel of the last forward

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` grouped by local expert, `counts[j]` rows for expert j (variable sizes). Every expert
        runs, on no rows too: every expert weight gets a gradient (zero) in every backward, so every
        rank's graph has the same shape and its gradient hooks fire alike (ZeRO-3's reductions).
        `kernel`: "auto" (`expert_kernel`; the loop when `linear` is set: fp8's per-tensor matmuls),
        or "grouped", "padded", "loop" as chosen."""
        kernel = self.kernel
        if kernel == "auto":
            kernel = "loop" if self.linear is not None or not rows.numel() else expert_kernel(
                rows, counts, self.w_up.shape[2], self.w_up.shape[1])
        self.last_kernel = kernel
        if kernel == "loop":
            return self._loop(rows, counts)
        if kernel == "grouped":
            offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
            return self._mlp(rows, lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
        # padded: row i of expert j at j * m + i of an (experts x m) block, m the largest count
        e, m = len(counts), max(counts)
        sizes = torch.tensor(counts, device=rows.device)
        expert_of = torch.repeat_interleave(torch.arange(e, device=rows.device), sizes, output_size=rows.shape[0])
        starts = sizes.cumsum(0) - sizes
        place = expert_of * m + torch.arange(rows.shape[0], device=rows.device) - starts[expert_of]
        padded = rows.new_zeros(e * m, rows.shape[1]).index_copy(0, place, rows).view(e, m, -1)
        out = self._mlp(padded, lambda x, w: torch.bmm(x, w.transpose(1, 2)))
        return out.reshape(e * m, -1)[place]

    def _mlp(self, x: torch.Tensor, mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The experts' MLP with `mm(x, stacked weight)` computing every expert's x W_e^T at once."""
        up = mm(x, self.w_up)
        act = F.silu(mm(x, self.w_gate)) * up if self.swiglu else F.gelu(up, approximate="tanh")
        return mm(act, self.w_down)

    def _loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs, start = [], 0
        for j, n in enumerate(counts):
            x = rows[start: start + n]
            start += n
            mm = self.linear if self.linear is not None and n else _matmul_t
            up = mm(x, self.w_up[j], None)
            act = F.silu(mm(x, self.w_gate[j], None)) * up if self.swiglu else F.gelu(up, approximate="tanh")
            outs.append(mm(act, self.w_down[j], None))
        return torch.cat(outs)


@dataclass
class RouterTally:
    """What the router did since the last `take()` (device tensors: no host read on the step path):
    kept assignments per expert, dropped ones, and the summed per-sequence balance loss and
    per-token z-loss (unweighted)."""

    kept: torch.Tensor | None = None  # (experts,) int64
    dropped: torch.Tensor | int = 0
    balance_sum: torch.Tensor | float = 0.0
    sequences: int = 0
    z_sum: torch.Tensor | float = 0.0
    tokens: int = 0

    def add(self, kept: torch.Tensor, dropped: torch.Tensor, balance_sum: torch.Tensor, sequences: int,
            z_sum: torch.Tensor, tokens: int) -> None:
        self.kept = kept if self.kept is None else self.kept + kept
        self.dropped = self.dropped + dropped
        self.balance_sum = self.balance_sum + balance_sum
        self.sequences += sequences
        self.z_sum = self.z_sum + z_sum
        self.tokens += tokens

    def row(self, experts: int, device: torch.device) -> torch.Tensor:
        """(experts + 5,) float64 on `device`: kept per expert, dropped, balance, z, sequences, tokens."""
        kept = (self.kept.to(device, torch.float64) if self.kept is not None
                else torch.zeros(experts, dtype=torch.float64, device=device))
        rest = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                for v in (self.dropped, self.balance_sum, self.z_sum, self.sequences, self.tokens)]
        return torch.cat([kept, torch.stack(rest)])


class MoE(nn.Module):
    """Router + routed experts (+ shared experts) in place of a block's MLP."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k = cfg.experts, cfg.experts_top_k
        self.capacity_factor = cfg.expert_capacity
        self.z_weight = cfg.router_z_weight
        self.balance, self.bias_rate = cfg.router_balance, cfg.router_bias_rate
        # the balance loss: Switch's under "aux", DeepSeek-V3's sequence-wise one (same formula) under "bias"
        self.aux_weight = cfg.router_seq_aux_weight if self.balance == "bias" else cfg.router_aux_weight
        if self.balance == "bias":  # fp32, built on the CPU explicitly (a meta build keeps its zeros)
            self.register_buffer("expert_bias", torch.zeros(cfg.experts, dtype=torch.float32, device="cpu"))
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = shared
        self.dispatch: ExpertDispatch = LocalDispatch()
        self.sequence: SequenceShards | None = None  # sequence parallelism: the holders of the rest
        self.tally = RouterTally()
        self.aux_sum: torch.Tensor | None = None  # this forward's weighted auxiliary losses (summed)

    def capacity(self, seq: int) -> int:
        """Assignments one expert takes from one sequence (0: unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * seq * self.top_k / self.num_experts)

    def _keep(self, idx_bsk: torch.Tensor, seq: int | None = None) -> torch.Tensor:
        """Which assignments fit their expert's capacity in their (whole, `seq`-long) sequence: first
        choices first, then by position; under sequence parallelism the parts held before this
        rank's come first."""
        b, s, k = idx_bsk.shape
        cap = self.capacity(seq or s)
        if cap == 0:
            return torch.ones_like(idx_bsk, dtype=torch.bool)
        onehot = F.one_hot(idx_bsk.transpose(1, 2), self.num_experts)  # (b, k, s, E)
        counts = onehot.sum(2)  # (b, k, E): assignments per choice and expert in this part
        before, total = 0, counts
        if self.sequence is not None and seq and seq != s:
            every = self.sequence.gather(counts)  # (parts, b, k, E)
            before, total = every[: self.sequence.rank].sum(0), every.sum(0)
        queued = total.cumsum(1) - total + before  # ahead of this part's first assignment of each choice
        position = (onehot.cumsum(2) + queued.unsqueeze(2)) * onehot  # 1-based place in the expert's queue
        keep = (position > 0) & (position <= cap)
        return keep.any(-1).transpose(1, 2)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        seq = s * (self.sequence.size if self.sequence is not None else 1)  # the whole sequence
        logits = self.router(x_bsh)  # (b, s, E), in fp32 at least
        logits = logits.float() if logits.element_size() < 4 else logits
        probs = logits.softmax(-1)
        if self.balance == "bias":  # the bias picks the experts; the weights are the unbiased probabilities
            idx = (probs + self.fp32_bias()).topk(self.top_k, dim=-1).indices
            weight = probs.gather(-1, idx)
        else:
            weight, idx = probs.topk(self.top_k, dim=-1)  # (b, s, k)
        if self.top_k > 1:
            weight = weight / weight.sum(-1, keepdim=True)
        keep = self._keep(idx, seq)
        # dispatch: kept assignments sorted by expert (stable: token order within an expert)
        flat_idx, flat_keep = idx.reshape(-1), keep.reshape(-1)
        token = torch.arange(b * s, device=x_bsh.device).repeat_interleave(self.top_k)
        chosen = (flat_keep.nonzero().squeeze(1) if self.capacity(seq) else
                  torch.arange(flat_keep.numel(), device=x_bsh.device))  # dropless: no host read
        experts_of = flat_idx[chosen]
        assign = chosen[torch.argsort(experts_of, stable=True)]
        counts = torch.bincount(experts_of, minlength=self.num_experts)
        self._auxiliary(idx, probs, logits, counts, flat_keep, seq)
        x_th = x_bsh.reshape(b * s, h)
        out_rows = self.dispatch(x_th[token[assign]], counts, self.experts)
        scaled = out_rows * weight.reshape(-1)[assign].unsqueeze(1).to(out_rows.dtype)
        y = torch.zeros_like(x_th).index_add(0, token[assign], scaled).reshape(b, s, h)
        if self.shared is not None:
            y = y + self.shared(x_bsh)
        return y

    def _auxiliary(self, idx, probs, logits, counts, flat_keep, seq: int) -> None:
        """The auxiliary losses of the whole sequences (`aux_sum`) and the tally of a training forward.
        Per sequence: f_e (routed assignments) and P_e (mean probability); under sequence
        parallelism their parts, the z-losses and the counts are summed over the holders (one sum)."""
        b, e = idx.shape[0], self.num_experts
        routed = F.one_hot(idx, e).sum((1, 2)).float()  # (b, E) assignments per sequence (this part)
        prob_sum = probs.sum(1)  # (b, E)
        z = torch.logsumexp(logits, -1).square().sum(1)  # (b,)
        dropped = (~flat_keep).sum()
        if self.sequence is not None:
            packed = torch.cat([routed.flatten(), prob_sum.flatten(), z, counts.float(), dropped.float().reshape(1)])
            packed = self.sequence.sum(packed)
            routed, prob_sum = packed[: b * e].view(b, e), packed[b * e: 2 * b * e].view(b, e)
            z, counts, dropped = (packed[2 * b * e: 2 * b * e + b], packed[2 * b * e + b: -1].round().long(),
                                  packed[-1].round().long())
        balance = e * ((routed / (seq * self.top_k)) * (prob_sum / seq)).sum(-1)  # (b,)
        training = torch.is_grad_enabled() and not is_evaluating()
        self.aux_sum = seq * self.aux_weight * balance.sum() + self.z_weight * z.sum()
        reports = self.sequence is None or self.sequence.reports
        if not reports:  # another holder reports the value; this one differentiates its own part
            self.aux_sum = self.aux_sum - self.aux_sum.detach()
        if not training:  # evaluation: the loss is the cross-entropy alone
            self.aux_sum = torch.zeros((), dtype=self.aux_sum.dtype, device=self.aux_sum.device)
        elif reports and not is_recomputing():  # a recomputation (activation checkpointing) was tallied the first time
            self.tally.add(counts.detach(), dropped.detach(), balance.detach().sum(), b, z.detach().sum(), b * seq)

    def fp32_bias(self) -> torch.Tensor:
        """The expert bias in fp32 (a compute-dtype cast of the model's buffers is undone: the bias moves
        by steps of `bias_rate`, which bf16 would round away)."""
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self.expert_bias

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free rule, after an optimizer step: b_e += rate x sign(mean load -
        load_e), `load` (experts,) this block's assignments per expert over the whole step (every rank's
        tokens and micro-batches: the same tensor on every rank, so every copy of the bias stays equal)."""
        load = load.to(torch.float64)
        bias = self.fp32_bias()
        bias.add_((load.mean() - load).sign().to(bias.dtype), alpha=self.bias_rate)

    def take_tally(self) -> RouterTally:
        tally, self.tally = self.tally, RouterTally()
        return tally


def routers_aux_loss(modules: list[nn.Module]) -> torch.Tensor | None:
    """The summed weighted auxiliary losses of the last forward of every MoE inside `modules` (a
    pipeline stage's layers), None when there is none."""
    found = [m.aux_sum for module in modules for m in module.modules() if isinstance(m, MoE) and m.aux_sum is not None]
    return sum(found[1:], found[0]) if found else None


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
