"""The reference decoder (models/decoder.py) as a model family: its `ModelSpec`."""

from __future__ import annotations

from ..config import ModelConfig
from .decoder import Attention, Decoder, Embedding, initial_value
from .decoder_plan import decoder_plan
from .reference_hf import reference_hf
from .spec import CausalAdapter, ContextSeams, ModelSpec


def decoder_spec(cfg: ModelConfig, seed: int) -> ModelSpec:
    tied = {"head.weight": "embed.tok.weight"} if cfg.tie_embeddings else {}
    return ModelSpec(
        family="threefold-decoder",
        build=lambda: Decoder(cfg),
        plan=lambda tp: decoder_plan(cfg),
        adapter=CausalAdapter(tied, cfg.loss_chunk),
        init=lambda name, shape: initial_value(name, shape, seed, cfg),
        tied=tied,
        hf=reference_hf(cfg),
        context=ContextSeams(attention=(Attention,), positions=(Embedding,)),
    )
