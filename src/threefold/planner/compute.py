"""FLOPs of a training step of the reference decoder, and model FLOPs utilisation (MFU).

Counted per token, one multiply-add = 2 FLOPs, as in Narayanan et al. 2021 (appendix) and the
PaLM paper's MFU: a block's forward does 2 x (its weight-matrix parameters) FLOPs plus 4*s*h for
attention (q.k^T and the weighted sum over all s keys; the causal half is not discounted, the
usual convention). The output projection adds 2*h*V. Backward costs twice the forward.
Recomputation adds the forward of what is checkpointed: every block (`full`), one block in k
(`every-k`) or the attention core's 4*s*h (`selective`). MFU counts model FLOPs only
(3 x forward); "hardware" FLOPs include recomputation (Megatron-LM's reported TFLOP/s do).
Time is another matter: a fused causal kernel (flash attention, what SDPA runs on a GPU) skips the
masked half of the scores, so the step time charges `executed_attention_share` (1/2) of the
attention FLOPs under `Workload.attention = "flash"` and all of them under "dense".
For GPT-3 175B this reproduces Narayanan et al.'s 96*B*s*l*h^2*(1 + s/6h + V/16lh) exactly
when recomputation is full.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from .moe import dense_mlp_flops_per_token, sparse_blocks, sparse_mlp_flops_per_token
from .workload import Strategy, Workload


def block_matmul_params(m: ModelConfig) -> int:
    """Weights of one block's matrix multiplications (biases and norms do no matmul)."""
    kv = m.kv_heads * m.head_dim
    attn = 2 * m.hidden * m.attn_width + 2 * m.hidden * kv
    return attn + (3 if m.mlp == "swiglu" else 2) * m.hidden * m.ffn_hidden


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    return 4 * seq_len * m.hidden


def executed_attention_share(attention: str) -> float:
    """The share of the counted attention FLOPs the kernel executes: a causal flash kernel skips
    the blocks above the diagonal (half, for long sequences); a dense one computes them all."""
    return 0.5 if attention == "flash" else 1.0


def block_forward_flops_per_token(m: ModelConfig, seq_len: int, attention_share: float = 1.0,
                                  sparse: bool = False) -> float:
    """A block's forward per token; a sparse block's MLP is its router, kept experts and shared experts."""
    flops = 2 * block_matmul_params(m) + attention_share * attention_flops_per_token(m, seq_len)
    return flops + (sparse_mlp_flops_per_token(m, seq_len) - dense_mlp_flops_per_token(m) if sparse else 0.0)


def blocks_forward_flops_per_token(m: ModelConfig, seq_len: int, layers: int, sparse: int = 0,
                                   attention_share: float = 1.0) -> float:
    """`layers` blocks of which `sparse` are mixtures of experts."""
    return ((layers - sparse) * block_forward_flops_per_token(m, seq_len, attention_share)
            + sparse * block_forward_flops_per_token(m, seq_len, attention_share, True))


def head_forward_flops_per_token(m: ModelConfig) -> float:
    return 2 * m.hidden * m.padded_vocab  # the padded vocabulary (model.vocab_multiple): the matmul computes it


def recomputed_forward_flops_per_token(m: ModelConfig, seq_len: int, policy: str, layers: int, every: int = 2,
                                       attention_share: float = 1.0, sparse: int = 0) -> float:
    """Forward work redone in backward; `sparse` of the `layers` blocks are mixtures of experts (every-k
    redoes their average block)."""
    whole = blocks_forward_flops_per_token(m, seq_len, layers, sparse, attention_share)
    if policy == "full":
        return whole
    if policy == "every-k":
        return math.ceil(layers / max(1, every)) * whole / max(1, layers)
    if policy == "selective":
        return layers * attention_share * attention_flops_per_token(m, seq_len)
    return 0.0


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward + backward of the whole model, no recomputation."""
    return 3 * (blocks_forward_flops_per_token(m, seq_len, m.layers, sparse_blocks(m)) + head_forward_flops_per_token(m))


def step_flops(w: Workload, st: Strategy, hardware: bool = True) -> float:
    """FLOPs of one optimizer step over all GPUs (with recomputation when `hardware`)."""
    per_token = model_flops_per_token(w.model, w.seq_len)
    if hardware:
        per_token += recomputed_forward_flops_per_token(w.model, w.seq_len, st.remat, w.model.layers, st.remat_every,
                                                        sparse=sparse_blocks(w.model))
    return per_token * w.tokens


def mfu(w: Workload, step_time_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second over the cluster's dense peak."""
    return step_flops(w, Strategy(), hardware=False) / (step_time_s * gpus * peak_flops)
