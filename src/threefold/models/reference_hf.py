"""The reference decoder (models/decoder.py) as a Hugging Face model: a Llama or a GPT-2 directory.

Llama variant (rmsnorm, swiglu, rope) -> `LlamaForCausalLM`. The names map one to one, with one
difference in the numbers: the reference decoder rotates the pairs (x[2i], x[2i+1]) of each head,
the library's Llama the pairs (x[i], x[i + d/2]) (`rotate_half`). Both rotate pair i by the same
angle, so permuting the rows of each head of q and k (and their biases) by
[0, 2, 4, ..., d-2, 1, 3, ..., d-1] turns one into the other: q.k is unchanged when q and k are
permuted alike, and v, o are untouched.

GPT variant (layernorm, gelu, learned positions, biases, tied embedding, kv_heads = heads) ->
`GPT2LMHeadModel`: q, k, v fused into `c_attn` and every projection transposed (GPT-2's Conv1D
stores in x out); GELU is the tanh approximation (`gelu_new`) on both sides.

Other combinations have no library equivalent: `why_not` names the field.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .decoder import VOCAB_ROWS
from .spec import HFFormat, HFTensor

LLAMA_RENAMES = ((r"^embed\.tok\.", "model.embed_tokens."),
                 (r"^blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
                 (r"^blocks\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
                 (r"^blocks\.(\d+)\.attn\.(q|k|v|o)\.", r"model.layers.\1.self_attn.\2_proj."),
                 (r"^blocks\.(\d+)\.mlp\.(gate|up|down)\.", r"model.layers.\1.mlp.\2_proj."),
                 (r"^norm\.", "model.norm."), (r"^head\.", "lm_head."))
GPT2_RENAMES = ((r"^embed\.tok\.", "transformer.wte."), (r"^embed\.pos\.", "transformer.wpe."),
                (r"^blocks\.(\d+)\.attn_norm\.", r"transformer.h.\1.ln_1."),
                (r"^blocks\.(\d+)\.mlp_norm\.", r"transformer.h.\1.ln_2."),
                (r"^blocks\.(\d+)\.attn\.o\.", r"transformer.h.\1.attn.c_proj."),
                (r"^blocks\.(\d+)\.mlp\.up\.", r"transformer.h.\1.mlp.c_fc."),
                (r"^blocks\.(\d+)\.mlp\.down\.", r"transformer.h.\1.mlp.c_proj."),
                (r"^norm\.", "transformer.ln_f."), (r"^head\.", "lm_head."))


def why_not(cfg: ModelConfig) -> str | None:
    """None when `cfg` has a Hugging Face equivalent, else which field prevents it."""
    if cfg.experts:
        return f"model.experts={cfg.experts}: a mixture of experts has no Hugging Face export yet"
    if cfg.head_size and cfg.head_size * cfg.heads != cfg.hidden:
        return f"model.head_size={cfg.head_size} x heads != hidden has no Llama / GPT-2 equivalent here"
    if (cfg.norm, cfg.mlp, cfg.position) == ("rmsnorm", "swiglu", "rope"):
        return None
    if (cfg.norm, cfg.mlp, cfg.position) == ("layernorm", "gelu", "learned"):
        for ok, field in ((cfg.bias, "model.bias=false"), (cfg.tie_embeddings, "model.tie_embeddings=false"),
                          (cfg.kv_heads == cfg.heads, f"model.kv_heads={cfg.kv_heads} < heads")):
            if not ok:
                return f"{field} has no GPT-2 equivalent (GPT-2 has biases, a tied embedding, kv_heads = heads)"
        return None
    return (f"model.norm={cfg.norm}, mlp={cfg.mlp}, position={cfg.position} is neither Llama's "
            "(rmsnorm, swiglu, rope) nor GPT-2's (layernorm, gelu, learned)")


def reference_hf(cfg: ModelConfig) -> HFFormat | None:
    """The Hugging Face form of the reference decoder of `cfg`, or None (`why_not` says why)."""
    if why_not(cfg) is not None:
        return None
    if cfg.position == "rope":
        return HFFormat(LLAMA_RENAMES, llama_config(cfg), exports=lambda names: llama_tensors(cfg, names))
    return HFFormat(GPT2_RENAMES, gpt2_config(cfg), exports=lambda names: gpt2_tensors(cfg, names))


def llama_config(cfg: ModelConfig) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None}


def gpt2_config(cfg: ModelConfig) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab,
            "n_embd": cfg.hidden, "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.ffn_hidden,
            "n_positions": cfg.max_seq, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": cfg.init_std,
            "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None}


def rope_pairs_to_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered from interleaved pairs (2i, 2i+1) to halves (i, i + d/2)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    heads = t.unflatten(0, (-1, head_dim))
    return heads[:, order].flatten(0, 1).contiguous()


def llama_tensors(cfg: ModelConfig, names: list[str]) -> list[HFTensor]:
    fmt = HFFormat(LLAMA_RENAMES)
    out = []
    for name in names:
        rotated = ".attn.q." in name or ".attn.k." in name
        combine = (lambda ts: rope_pairs_to_halves(ts[0], cfg.head_dim)) if rotated else real_rows(cfg, name)
        out.append(HFTensor(fmt.key_of(name), (name,), combine))
    return out


def real_rows(cfg: ModelConfig, name: str):
    """The combine writing only the real vocabulary's rows of a padded embedding or head (`model.vocab_multiple`)."""
    if name in VOCAB_ROWS and cfg.padded_vocab > cfg.vocab:
        return lambda ts: ts[0][:cfg.vocab].clone()  # its own storage: safetensors writes whole storages
    return None


def gpt2_tensors(cfg: ModelConfig, names: list[str]) -> list[HFTensor]:
    """q, k, v -> c_attn (weights transposed: Conv1D is in x out); the other projections transposed."""
    fmt = HFFormat(GPT2_RENAMES)
    out = []
    for name in names:
        block, dot, rest = name.partition(".attn.")
        if dot and rest in ("k.weight", "v.weight", "k.bias", "v.bias"):
            continue  # written with q, into c_attn
        if dot and rest in ("q.weight", "q.bias"):
            kind = rest[2:]
            i = block.split(".")[1]
            sources = tuple(f"{block}.attn.{p}.{kind}" for p in "qkv")
            fused = (lambda ts: torch.cat(ts).t().contiguous()) if kind == "weight" else (lambda ts: torch.cat(ts))
            out.append(HFTensor(f"transformer.h.{i}.attn.c_attn.{kind}", sources, fused))
            continue
        linear = name.endswith("weight") and (".attn.o." in name or ".mlp." in name)
        out.append(HFTensor(fmt.key_of(name), (name,), (lambda ts: ts[0].t().contiguous()) if linear else
                            real_rows(cfg, name)))
    return out
