"""Hugging Face mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE (`MixtralForCausalLM`,
`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`).

The attention, norms, embedding and head are the library's modules, arranged as for the dense
families (models/hf_causal.py). The sparse MLP of a layer is `HFSparseMoE`, a threefold `MoE`
(models/moe.py) with the library's routing, so expert parallelism, the router metrics and the
checkpoint reshard treat it as the reference decoder's:

    blocks.<i>.layer.mlp.router          the library's router weight (experts, hidden)
    blocks.<i>.layer.mlp.experts.w_gate  (experts, width, hidden)   stacked, as models/moe.py
    blocks.<i>.layer.mlp.experts.w_up    (experts, width, hidden)
    blocks.<i>.layer.mlp.experts.w_down  (experts, hidden, width)
    blocks.<i>.layer.mlp.shared          Qwen2-MoE's shared expert (the library's MLP)
    blocks.<i>.layer.mlp.shared_gate     Qwen2-MoE's sigmoid gate of the shared expert

Checkpoints of these models store the experts one by one (Mixtral
`block_sparse_moe.experts.<e>.w1/w3/w2`, Qwen `mlp.experts.<e>.gate_proj/up_proj/down_proj`):
a stacked parameter is read from, and exported as, one tensor per expert (`ROW` in its key).

Routing is the library's: softmax of the router's logits in fp32, the top k, renormalised
for Mixtral and for Qwen when `norm_topk_prob`; dropless (every expert takes every token
routed to it). The load-balancing loss is the library's `load_balancing_loss_func` - E x
sum_e f_e P_e with f_e and P_e summed over all sparse layers before the product - added with
`router_aux_loss_coef` when config.json has `output_router_logits` (the library adds it to its
training loss only then). The library computes it over the whole batch of one forward; here it
is computed per sequence and averaged over sequences, so that it does not depend on how a
batch is split over ranks and micro-batches (for a forward of one sequence the two agree).
Like the reference decoder's, it is added to the summed token loss as s x aux per sequence
(the trainer's division by the token count makes it the mean) in training forwards only.

When a sparse MLP sees only its part of every sequence - context parallelism (zigzag chunks on each
cp rank; dropless routing, as here), sequence parallelism (a tp rank's chunk) or both - its `sequence`
(a `SequenceShards`, set by parallel/expert.py, as for the reference decoder's MoE) sums the
per-sequence assignments and probability sums of every sparse layer over the holders (one all-reduce;
the backward is the identity, so each holder differentiates the whole sequence's loss through its own
tokens), and the loss is that of the whole sequences (s x the holders). Only a holder that `reports`
keeps its value and tallies it (under cp the loss is summed over the cp ranks: the first one); the
others add a term of value 0 with the same gradient.

Tensor parallelism: attention (and the dense MLPs of Qwen's non-sparse layers) split as for
the dense families; a sparse MLP stays whole on every tp rank, as the reference decoder's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..config.hf import MoEShape, moe_shape
from .decoder import causal_forward
from .hf_causal import HF_RENAMES, HFBlock, HFCausalLM, hf_init, hf_plan, trained_config
from .moe import MoE
from .spec import ROW, CausalAdapter, ContextSeams, HFFormat, ModelSpec

_LAYER = r"^blocks\.(\d+)\.layer\.mlp\."
# (our stacked expert tensor, the library's per-expert name) and where the MLP sits in the checkpoint
_EXPERT_KEYS = {"MixtralForCausalLM": ("block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}),
                "Qwen2MoeForCausalLM": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
                "Qwen3MoeForCausalLM": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"})}


def moe_renames(arch: str) -> tuple[tuple[str, str], ...]:
    """Our names -> the library's checkpoint keys (before the dense families' renames)."""
    mlp, experts = _EXPERT_KEYS[arch]
    out = [(_LAYER + r"router\.", rf"model.layers.\1.{mlp}.gate."),
           (_LAYER + r"shared\.", r"model.layers.\1.mlp.shared_expert."),
           (_LAYER + r"shared_gate\.", r"model.layers.\1.mlp.shared_expert_gate.")]
    out += [(_LAYER + rf"experts\.{ours}$", rf"model.layers.\1.{mlp}.experts.{ROW}.{theirs}.weight")
            for ours, theirs in experts.items()]
    return tuple(out)


class HFSparseMoE(MoE):
    """A library sparse MLP as a threefold `MoE`: the library's routing, threefold's stacked experts
    and dispatch (so expert parallelism replaces the dispatch), Qwen2-MoE's gated shared expert."""

    def __init__(self, cfg: ModelConfig, shape: MoEShape, shared=None, shared_gate=None):
        super().__init__(cfg, shared)
        self.shared_gate = shared_gate
        self.norm_topk = shape.norm_topk
        # this part of every sequence: (assignments (b, E), probability sums (b, E), its length)
        self.routed: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        logits = self.router(x_bsh)
        probs = logits.float().softmax(-1)
        weight, idx = probs.topk(self.top_k, dim=-1)  # (b, s, k)
        if self.norm_topk:
            weight = weight / weight.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        assign = torch.argsort(flat, stable=True)  # assignments by expert, token order within one
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = torch.arange(b * s, device=x_bsh.device).repeat_interleave(self.top_k)[assign]
        x_th = x_bsh.reshape(b * s, h)
        out_rows = self.dispatch(x_th[token], counts, self.experts)
        scaled = (out_rows * weight.reshape(-1)[assign].unsqueeze(1)).to(x_bsh.dtype)
        y = torch.zeros_like(x_th).index_add(0, token, scaled).reshape(b, s, h)
        if torch.is_grad_enabled():
            self.routed = (F.one_hot(idx, self.num_experts).sum((1, 2)), probs.sum(1), s)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(x_bsh)) * self.shared(x_bsh)
        return y


class HFMoECausalLM(HFCausalLM):
    """A library mixture of experts in threefold's shape, its sparse MLPs replaced by `HFSparseMoE`."""

    def __init__(self, config, shape: MoEShape, cfg: ModelConfig):
        super().__init__(config)
        for i, block in enumerate(self.blocks):
            if shape.is_sparse(i):
                library = block.layer.mlp
                shared = (library.shared_expert, library.shared_expert_gate) if shape.shared_width else (None, None)
                block.layer.mlp = HFSparseMoE(cfg, shape, *shared)
        self.aux_coef = shape.aux_coef

    def forward(self, tokens_bs, targets_bs=None):
        out = causal_forward(self, tokens_bs, targets_bs)
        if targets_bs is None or not torch.is_grad_enabled():
            return out  # logits, or an evaluation loss (the cross-entropy alone)
        return out + self._balance()

    def _balance(self) -> torch.Tensor:
        """The load-balancing loss of this forward's sequences, summed as token losses are (s x aux of
        each sequence); files each layer's share of it and its routed tokens in the layer's tally. A
        layer that holds a part of each sequence (`sequence`) sums the statistics over the holders."""
        sparse = [m for m in self.modules() if isinstance(m, HFSparseMoE)]
        routed = [m.routed for m in sparse]
        counts, probs = [c for c, _, _ in routed], [p for _, p, _ in routed]  # (b, E) each: this part's
        s, sequence = routed[0][2], sparse[0].sequence  # every sparse layer: the same part, the same holders
        if sequence is not None:  # the other parts' too (forward all-reduce, identity backward)
            n, b_e = len(sparse), counts[0].numel()
            packed = sequence.sum(torch.cat([torch.stack(counts).float().flatten(), torch.stack(probs).flatten()]))
            counts = list(packed[: n * b_e].round().long().view(n, *counts[0].shape))
            probs = list(packed[n * b_e:].view(n, *probs[0].shape))
            s = s * sequence.size  # the whole sequence
        total = sum(counts).float()  # (b, E): assignments per sequence over all sparse layers
        rows = len(sparse) * s
        # E sum_e (C_e / rows)(P_e / rows), P_e summed over layers: each layer's share is its P's part
        shares = [sparse[0].num_experts * (total * p).sum(-1) / rows ** 2 for p in probs]  # (b,) each
        reports = sequence is None or sequence.reports
        for m, c, share in zip(sparse, counts, shares):
            if reports:
                m.tally.add(c.sum(0), 0, share.detach().sum(), c.shape[0], 0.0, c.shape[0] * s)
            m.routed = None
        aux = self.aux_coef * s * torch.stack(shares).sum()
        return aux if reports else aux - aux.detach()  # another holder reports the value


def moe_config(shape: MoEShape, hidden: int) -> ModelConfig:
    """The `MoE` sizes of one sparse layer (its aux weight is the one the metrics report)."""
    return ModelConfig(hidden=hidden, experts=shape.experts, experts_top_k=shape.top_k, expert_ffn_hidden=shape.width,
                       mlp="swiglu", expert_capacity=0.0, router_aux_weight=shape.aux_coef, router_z_weight=0.0)


def moe_spec(directory: Path, config, seed: int) -> ModelSpec:
    raw = json.loads((Path(directory) / "config.json").read_text())
    shape = moe_shape(raw, directory)
    cfg = moe_config(shape, config.hidden_size)
    dense = [str(i) for i in range(config.num_hidden_layers) if not shape.is_sparse(i)]
    tied = {"head.weight": "embed.weight"} if config.tie_word_embeddings else {}
    arch = config.architectures[0]
    return ModelSpec(
        family=arch,
        build=lambda: HFMoECausalLM(config, shape, cfg),
        plan=lambda tp: hf_plan(config, tp, dense),
        adapter=CausalAdapter(tied),
        init=hf_init(config, seed),
        tied=tied,
        hf=HFFormat(moe_renames(arch) + HF_RENAMES, trained_config(directory), Path(directory)),
        selective=("layer.self_attn",),
        context=ContextSeams(attention=(HFBlock,)),
    )
