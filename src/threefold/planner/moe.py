"""Parameter counts of a mixture of experts (models/moe.py): totals and the parameters one token uses.

A sparse block replaces the dense MLP (gate?, up, down of `ffn_hidden`) by a router
(hidden x experts), `experts` stacked expert MLPs of `expert_ffn_hidden` (no biases) and an
optional shared MLP of `shared_experts x expert_ffn_hidden`. A token uses `experts_top_k` of
the routed experts: `workload.active_parameters` counts only those (embeddings and head included, as
the published "active" figures do).

Not modelled yet: expert parallelism in the layout search (memory per ep rank, all-to-all time).
"""

from __future__ import annotations

from ..config import ModelConfig


def _mats(m: ModelConfig) -> int:
    return 3 if m.mlp == "swiglu" else 2


def dense_mlp_parameters(m: ModelConfig, width: int) -> int:
    b = 1 if m.bias else 0
    return _mats(m) * m.hidden * width + b * ((_mats(m) - 1) * width + m.hidden)


def expert_parameters(m: ModelConfig) -> int:
    """One routed expert's weights."""
    return _mats(m) * m.hidden * m.expert_width


def sparse_block_extra(m: ModelConfig) -> int:
    """Parameters a sparse block has beyond a dense block of the same model."""
    shared = dense_mlp_parameters(m, m.shared_experts * m.expert_width) if m.shared_experts else 0
    return (m.hidden * m.experts + m.experts * expert_parameters(m) + shared
            - dense_mlp_parameters(m, m.ffn_hidden))


def sparse_blocks(m: ModelConfig) -> int:
    return sum(m.is_moe_block(i) for i in range(m.layers))
