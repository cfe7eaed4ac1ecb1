"""The attention seam of the Hugging Face families (models/hf_causal.py, hf_moe.py, hf_gpt2.py): the
library's attention modules call threefold's attention function, which runs the library's own SDPA
path unless the block hands it a core.

The library's attention (`LlamaAttention` and its Mistral, Qwen2, Qwen3, Mixtral and Qwen-MoE kin;
GPT-2's `GPT2Attention`) projects q, k and v, applies the rotary embedding the block gave it (GPT-2 has
none: its learned positions are added by the embedding), and calls `ALL_ATTENTION_FUNCTIONS[config.
_attn_implementation]` with q (b, heads, s, d), k and v (b, kv_heads, s, d) - kv heads not repeated -,
its mask, `scaling` and the keyword arguments the decoder layer was called with; the function returns
(b, s, heads, d). `register` adds `attention` to that table under `ATTENTION`, the name `HFCausalLM`
and `GPT2CausalLM` set in the library model's config. The block (`HFBlock`, `GPT2Block`) passes its
`attention_core` through the layer's keyword arguments:

    no core (None)   `sdpa_attention_forward` itself, with the same arguments: bitwise the library's
    a core           `core(q, k, v, scaling)` -> (b, heads, s, d), transposed to the library's layout;
                     context parallelism's `ContextCore` (parallel/context.py), whose
                     `rotary_positions` `HFBlock` feeds to the rotary embedding instead of 0 .. s-1
                     (GPT-2's embedding gets the same positions from parallel/context.py `_wire`)

A core replaces the whole attention: it takes no mask and no dropout (the config refuses sliding
windows narrower than the sequence under cp and data.pack, and every family trains without dropout).

A sliding window: the block hands the layer its window when the window is narrower than the sequence
(`attention_window`, passed through the layer to this function; no s x s mask is built); that
attention runs on the fused kernels by blocks (models/
attention.py `window_attention`: per chunk of `window` queries, the causal diagonal and a reversed
causal triangle in the chunk before), where SDPA under the boolean mask would leave the flash kernels.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .attention import window_attention

ATTENTION = "threefold"  # the name in transformers' AttentionInterface (config._attn_implementation)


class HFAttentionCore(Protocol):
    """What replaces a library attention once q, k, v are projected and rotated: the positions of the
    local tokens for the rotary embedding, and the attention itself at the module's `scaling`."""

    def rotary_positions(self, seq: int, device) -> torch.Tensor | None:
        """The rotary positions of the `seq` local tokens, (s,) or (b, s); None: 0 .. seq-1."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Attention output (b, heads, s, d) of q (b, heads, s, d), k and v (b, kv_heads, s, d)."""


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              attention_core: HFAttentionCore | None = None, attention_window: int | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """The library's attention-function signature: the library's SDPA path, `attention_core`, or (the
    block's `attention_window`, narrower than the sequence) the window on the fused kernels."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_core is None:
        if attention_window is not None:
            if dropout:
                raise ValueError("a sliding window on the fused kernels takes no dropout")
            return window_attention(query, key, value, attention_window, scaling).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None or dropout:
        raise ValueError("an attention core replaces the whole attention: it takes no mask and no dropout")
    return attention_core(query, key, value, scaling).transpose(1, 2).contiguous(), None


def register() -> None:
    """`attention` in transformers' global AttentionInterface under `ATTENTION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
