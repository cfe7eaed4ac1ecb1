"""Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025): orthogonalised momentum for the hidden
2-D weights, AdamW for the rest (embeddings, the output head, biases and norm gains).

For a hidden matrix W with gradient G (the fp32 master's, after clipping), per step:

    M <- mu M + (1 - mu) G                         (momentum_buffer; Keller Jordan's lerp form)
    U  = (1 - mu) G + mu M   if nesterov, else M
    O  = NS_k(U)                                   k = train.muon_ns_steps quintic Newton-Schulz
                                                   iterations (a, b, c) = (3.4445, -4.7750, 2.0315)
                                                   on U / ||U||_F, in fp32
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) * O

The scale is Moonlight's rule: an orthogonal m x n update has RMS 1 / sqrt(max(m, n)), so the
factor 0.2 sqrt(max(m, n)) gives it AdamW's typical update RMS (~0.2) and Muon runs with AdamW's
learning rate and weight decay (`train.lr`, `train.weight_decay`) for every parameter.

The momentum and the update are elementwise, so they run on any piece of the matrix (ZeRO's flat
ranges, tp's boxes); NS needs the whole matrix: optim/exchange.py assembles each matrix on one
owner rank, orthogonalises it there and scatters the result back.
"""

from __future__ import annotations

from ..config import TrainConfig
from .adamw import KINDS as ADAM_KINDS
from .entry import Made, Matrices, OptimizerEntry

KINDS = ("momentum_buffer",)
EMBEDDING_PARTS = frozenset({"embed", "embeddings", "embed_tokens", "wte", "wpe", "lm_head", "head", "output"})


def hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight that is neither an embedding nor the output head (those take AdamW, as in Muon's reference)."""
    return len(shape) == 2 and not EMBEDDING_PARTS & set(name.split("."))


def states(cfg: TrainConfig, matrix: bool = True) -> tuple[str, ...]:
    return KINDS if matrix else ADAM_KINDS


def make(groups: list[dict], cfg: TrainConfig, fused: bool, matrices: Matrices | None = None) -> Made:
    from .muon_step import Muon  # torch: imported when an optimizer is made, not when the registry is read

    if matrices is None:
        raise ValueError("muon needs whole matrices: build it through parallel/master.py's ShardedOptimizer")
    inner = Muon(groups, cfg, matrices, KINDS)
    return Made(inner, inner.kinds)


ENTRY = OptimizerEntry("muon", make, states, whole_matrices=True,
                       summary="Muon: Newton-Schulz orthogonalised momentum on hidden matrices, AdamW on the rest")
