"""What the pipeline needs to know about a model: its layer list and its two ends.

No graph tracer: a model is cut between the layers of one list, with the modules before the
list (embedding) on the first stage and the modules after it (final norm, head, loss) on the
last. An adapter names those parts and runs them; one small class per model family.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class PipelineAdapter(Protocol):
    layers: str  # attribute holding the nn.ModuleList cut into stages
    first: tuple[str, ...]  # modules that run before the layers (first stage)
    last: tuple[str, ...]  # modules that run after the layers (last stage)

    def tied(self, model: nn.Module) -> dict[str, str]:
        """{name on the last stage: global name on the first stage} of weights shared by both ends."""

    def embed(self, module: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor: ...

    def head_loss(self, module: nn.Module, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor: ...

    def activation_shape(self, model_cfg, tokens_shape: tuple[int, ...]) -> tuple[int, ...]: ...


class DecoderAdapter:
    """The reference decoder (models/decoder.py): embed -> blocks -> norm -> head -> loss."""

    layers = "blocks"
    first = ("embed",)
    last = ("norm", "head", "loss")

    def tied(self, model: nn.Module) -> dict[str, str]:
        return {"head.weight": "embed.tok.weight"} if model.cfg.tie_embeddings else {}

    def embed(self, module: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor:
        return module.embed(tokens_bs)

    def head_loss(self, module: nn.Module, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """Summed token loss (fp32, 0-dim) of the last stage's output."""
        return module.loss(module.head(module.norm(x_bsh)), targets_bs)

    def activation_shape(self, model_cfg, tokens_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What flows between stages for a micro-batch of token ids of `tokens_shape`: x_bsh."""
        return (*tokens_shape, model_cfg.hidden)


def adapter_for(model: nn.Module) -> PipelineAdapter:
    from ..models.decoder import Decoder

    if isinstance(model, Decoder):
        return DecoderAdapter()
    raise TypeError(f"no pipeline adapter for {type(model).__name__}; write one (see pipeline/adapter.py)")
