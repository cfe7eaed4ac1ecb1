"""The tensor plan of the reference decoder: which modules split over tp, and how.

Megatron-LM's layout: per block, attention heads are split (q by heads, k/v by key/value
heads or replicated when there are fewer of them than ranks), the attention output
projection is row-parallel, the MLP is column (gate, up) then row (down). Attention and MLP
are the two tensor-parallel regions of a block, so a block costs two all-reduces forward and
two backward. The token embedding, the output head (tied or not) and the loss split the
vocabulary, padded to a multiple of tp. Under sequence parallelism the norms run on
sequence chunks and the learned position table is cut along the sequence.

The multi-token prediction depths (`mtp.<k>`, models/mtp.py) split their block as a dense block;
their norms and their 2h -> h projection stay whole on every tp rank (under sequence parallelism
they run on sequence chunks, their gradients summed over tp as the norms' are).
"""

from __future__ import annotations

from ..config import ModelConfig
from .plans import (ColumnParallel, GroupedKV, RowParallel, TensorPlan, VocabEmbedding, VocabHead,
                     VocabLoss)


def decoder_plan(cfg: ModelConfig) -> TensorPlan:
    heads = f"attention heads (model.heads={cfg.heads})"
    ffn = f"MLP features (model.ffn_hidden={cfg.ffn_hidden})"
    layers = {
        "embed.tok": VocabEmbedding(cfg.padded_vocab),
        "blocks.*.attn.q": ColumnParallel(unit=cfg.head_dim, what=heads),
        "blocks.*.attn.k": GroupedKV(cfg.heads, cfg.kv_heads, cfg.head_dim),
        "blocks.*.attn.v": GroupedKV(cfg.heads, cfg.kv_heads, cfg.head_dim),
        "blocks.*.attn.o": RowParallel(unit=cfg.head_dim, what=heads),
        "head": VocabHead(cfg.padded_vocab),
        "loss": VocabLoss(cfg.padded_vocab, cfg.vocab),
    }
    # dense MLPs split; a mixture of experts (models/moe.py) stays whole on every tp rank: its
    # router, experts and shared experts are replicated over tp and compute the same rows
    dense = ["*"] if cfg.experts == 0 else [str(i) for i in range(cfg.layers) if not cfg.is_moe_block(i)]
    for block in dense:
        layers[f"blocks.{block}.mlp.up"] = ColumnParallel(what=ffn)
        layers[f"blocks.{block}.mlp.down"] = RowParallel(what=ffn)
        if cfg.mlp == "swiglu":
            layers[f"blocks.{block}.mlp.gate"] = ColumnParallel(what=ffn)
    mtp = ("mtp.*.block.attn", "mtp.*.block.mlp") if cfg.mtp_depth else ()
    if cfg.mtp_depth:
        layers.update({f"mtp.*.block.{name}": layers[f"blocks.*.{name}"] for name in ("attn.q", "attn.k", "attn.v",
                                                                                      "attn.o")})
        layers.update({f"mtp.*.block.mlp.{name}": style for name, style in
                       (("up", ColumnParallel(what=ffn)), ("down", RowParallel(what=ffn)),
                        *((("gate", ColumnParallel(what=ffn)),) if cfg.mlp == "swiglu" else ()))})
    mtp_sequence = tuple(f"mtp.*.{name}" for name in ("hidden_norm", "embed_norm", "proj", "block.attn_norm",
                                                      "block.mlp_norm", "norm")) if cfg.mtp_depth else ()
    return TensorPlan(
        layers=layers,
        regions=("blocks.*.attn", *(f"blocks.{block}.mlp" for block in dense), *mtp, "head"),
        sequence=("blocks.*.attn_norm", "blocks.*.mlp_norm", "norm", *mtp_sequence),
        scatter_sequence={"embed.pos": 0} if cfg.position == "learned" else {},
    )
