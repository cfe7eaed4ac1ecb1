"""Hugging Face GPT-2 (`GPT2LMHeadModel`), from the `transformers` classes themselves.

    embed.wte, embed.wpe   token and learned position embeddings (transformer.wte / .wpe)
    blocks.<i>             `GPT2Block`: the library's block's ln_1, attn, ln_2, mlp (transformer.h.<i>)
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

The attention seam (models/hf_attention.py), as for the dense families: the library's
`GPT2Attention` calls threefold's attention function (`config._attn_implementation = ATTENTION`),
the library's SDPA path unless the block has an `attention_core`. `GPT2Block` is the library
block's forward (pre-norm attention and MLP, each with its residual; no cross-attention:
`add_cross_attention` is refused) keeping the library's children under their own names, so the
checkpoint names, the tensor plan, the renames and the export are the library's; it hands its
`attention_core` to the attention. Context parallelism and packed rows (parallel/context.py
`_wire`) set that core (which attends over the cp ranks, by document when packed) and give
`GPT2Embedding` the positions of the local tokens (`positions`: the global zigzag index, or per
document when packed; None: 0 .. s-1) for `wpe`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .hf_attention import ATTENTION, HFAttentionCore, register as register_attention
from .plans import ColumnParallel, RowParallel, TensorPlan, VocabEmbedding, VocabHead, VocabLoss
from .decoder import TokenCrossEntropy, causal_forward
from .hf_causal import trained_config
from .spec import CausalAdapter, ContextSeams, HFFormat, ModelSpec, seeded_normal

HF_RENAMES = ((r"^embed\.wte\.", "transformer.wte."), (r"^embed\.wpe\.", "transformer.wpe."),
              (r"^blocks\.(\d+)\.", r"transformer.h.\1."), (r"^norm\.", "transformer.ln_f."), (r"^head\.", "lm_head."))


class GPT2Embedding(nn.Module):
    """Token plus learned position embedding; `positions` is the learned positions' seam (as the
    reference decoder's `Embedding`): the positions of the local tokens, (s,) or (b, s), when the
    sequence is split or packed (parallel/context.py sets them); None: 0 .. s-1."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, wpe
        self.positions: torch.Tensor | None = None

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        positions = (self.positions if self.positions is not None
                     else torch.arange(tokens_bs.shape[1], device=tokens_bs.device))
        return self.wte(tokens_bs) + self.wpe(positions)


class GPT2Block(nn.Module):
    """The library's `GPT2Block` without cross-attention: its children (ln_1, attn, ln_2, mlp) under
    their own names and its forward, the attention given `attention_core` (models/hf_attention.py;
    None: the library's SDPA path)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = layer.ln_1, layer.attn, layer.ln_2, layer.mlp
        self.attention_core: HFAttentionCore | None = None

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        x_bsh = self.attn(self.ln_1(x_bsh), attention_core=self.attention_core)[0] + x_bsh
        return x_bsh + self.mlp(self.ln_2(x_bsh))


class GPT2CausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        import transformers

        if config.add_cross_attention:
            raise UserError("model.preset: a GPT-2 with add_cross_attention=true (an encoder-decoder's decoder) is "
                            "not supported; use a config.json with add_cross_attention=false")
        register_attention()  # the library's attention calls threefold's seam (models/hf_attention.py),
        config._attn_implementation = ATTENTION  # which is the library's SDPA path unless a block has a core
        library = transformers.AutoModelForCausalLM.from_config(config)
        self.embed = GPT2Embedding(library.transformer.wte, library.transformer.wpe)
        self.blocks = nn.ModuleList(GPT2Block(layer) for layer in library.transformer.h)
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
        context=ContextSeams(attention=(GPT2Block,), positions=(GPT2Embedding,)),
    )
