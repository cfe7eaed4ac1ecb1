"""Hugging Face GPT-2 (`GPT2LMHeadModel`), from the `transformers` classes themselves.

    embed.wte, embed.wpe   token and learned position embeddings (transformer.wte / .wpe)
    blocks.<i>             the library's GPT2Block (transformer.h.<i>)
    norm, head             transformer.ln_f, lm_head (tied to the token embedding)
    loss                   summed token cross-entropy (threefold's; vocabulary-parallel under tp)

GPT-2 keeps q, k and v in one Conv1D, `c_attn` (weight: in x 3*hidden, the transpose of a
Linear's). Its tensor plan splits that fused tensor as three blocks - each rank keeps the
same heads of q, of k and of v (`ColumnParallel(fused=3)`, a strided Placement) - so the
library's `split(split_size)` still finds q, k, v, with `split_size` set to the local width.
MLP `c_fc` is column-parallel, both `c_proj` row-parallel (Conv1D: `transposed`). Dropout is
turned off (config.*_pdrop = 0, as for every family: config/hf.py DROPOUT), and the export's
config.json says 0: masks drawn per rank would break tensor parallelism and parity.
The key part of c_attn's bias is frozen (its gradient is identically zero, as the reference
decoder's key bias).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .plans import ColumnParallel, RowParallel, TensorPlan, VocabEmbedding, VocabHead, VocabLoss
from .decoder import TokenCrossEntropy, causal_forward
from .hf_causal import trained_config
from .spec import CausalAdapter, HFFormat, ModelSpec, seeded_normal

HF_RENAMES = ((r"^embed\.wte\.", "transformer.wte."), (r"^embed\.wpe\.", "transformer.wpe."),
              (r"^blocks\.(\d+)\.", r"transformer.h.\1."), (r"^norm\.", "transformer.ln_f."), (r"^head\.", "lm_head."))


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens_bs) + self.wpe(torch.arange(tokens_bs.shape[1], device=tokens_bs.device))


class GPT2CausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        import transformers

        library = transformers.AutoModelForCausalLM.from_config(config)
        self.embed = GPT2Embedding(library.transformer.wte, library.transformer.wpe)
        self.blocks = library.transformer.h
        self.norm = library.transformer.ln_f
        self.head = library.lm_head
        self.loss = TokenCrossEntropy()
        self.head.weight = self.embed.wte.weight

    def forward(self, tokens_bs, targets_bs=None):
        return causal_forward(self, tokens_bs, targets_bs)


def gpt2_plan(config, tp: int) -> TensorPlan:
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    what_heads = f"attention heads (n_head={heads} in config.json)"
    inner = config.n_inner or 4 * hidden
    what_ffn = f"MLP features (n_inner={inner} in config.json)"
    return TensorPlan(
        layers={
            "embed.wte": VocabEmbedding(config.vocab_size),
            "blocks.*.attn.c_attn": ColumnParallel(unit=head_dim, what=what_heads, fused=3, transposed=True),
            "blocks.*.attn.c_proj": RowParallel(unit=head_dim, what=what_heads, transposed=True),
            "blocks.*.mlp.c_fc": ColumnParallel(what=what_ffn, transposed=True),
            "blocks.*.mlp.c_proj": RowParallel(what=what_ffn, transposed=True),
            "head": VocabHead(config.vocab_size),
            "loss": VocabLoss(config.vocab_size),
        },
        regions=("blocks.*.attn", "blocks.*.mlp", "head"),
        sequence=("blocks.*.ln_1", "blocks.*.ln_2", "norm"),
        scatter_sequence={"embed.wpe": 0},
        attributes={"blocks.*.attn": {"split_size": hidden // tp, "num_heads": heads // tp,
                                      "embed_dim": hidden // tp}} if tp > 1 else {},
    )


def gpt2_init(config, seed: int):
    """Seeded values in the library's scheme: N(0, initializer_range), c_proj scaled by 1/sqrt(2 layers)."""
    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape)
        if ".ln_" in name or name.startswith("norm."):
            return torch.ones(shape)
        std = config.initializer_range
        if name.endswith("c_proj.weight"):
            std /= (2 * config.num_hidden_layers) ** 0.5
        return seeded_normal(seed, name, shape, std)
    return init


def freeze_key_bias(module: nn.Module) -> None:
    """c_attn's bias is [q | k | v] (locally [q_r | k_r | v_r]): the k part has an identically zero
    gradient (softmax is shift invariant); zero it, so training keeps it as it is."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        third = grad.shape[0] // 3
        return torch.cat([grad[:third], torch.zeros_like(grad[third:2 * third]), grad[2 * third:]])

    for name, sub in module.named_modules():
        if name.endswith("attn.c_attn") and sub.bias is not None and sub.bias.requires_grad:
            sub.bias.register_hook(hook)


def gpt2_spec(directory: Path, config, seed: int) -> ModelSpec:
    config._attn_implementation = "sdpa"
    tied = {"head.weight": "embed.wte.weight"}
    return ModelSpec(
        family="GPT2LMHeadModel",
        build=lambda: GPT2CausalLM(config),
        plan=lambda tp: gpt2_plan(config, tp),
        adapter=CausalAdapter(tied),
        init=gpt2_init(config, seed),
        tied=tied,
        local_hooks=freeze_key_bias,
        hf=HFFormat(HF_RENAMES, trained_config(directory), Path(directory)),
        selective=("attn",),  # GPT2Attention: projections and the attention itself
    )
