"""What the pipeline needs to know about a model: its layer list and its two ends.

No graph tracer: a model is cut between the layers of one list, with the modules before the
list (embedding) on the first stage and the modules after it (final norm, head, loss) on the
last. The adapter that names those parts and runs them is part of the model's contract
(`ModelSpec.adapter`, models/spec.py); every family in models/ has the same shape
(`CausalAdapter`).

Multi-token prediction (`model.mtp_depth`, models/mtp.py) puts its depths on the last stage, as
DeepSeek-V3 does (`MTPAdapter`): they embed tokens with the shared embedding, so the last stage
keeps a copy of it, whose gradient is summed with the first stage's after the schedule as a tied
weight's is (split.py `shared_names`, `sum_tied_gradients`). The tokens they embed are the main
targets shifted (models/mtp.py `depth_targets`): the last stage needs no input ids.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.mtp import mtp_loss
from ..models.spec import CausalAdapter, PipelineAdapter

__all__ = ["CausalAdapter", "DecoderAdapter", "MTPAdapter", "PipelineAdapter"]


class DecoderAdapter(CausalAdapter):
    """The reference decoder's adapter, reading its tie from the model (for code holding only the module)."""

    def tied(self, model: nn.Module) -> dict[str, str]:
        return {"head.weight": "embed.tok.weight"} if model.cfg.tie_embeddings else {}


class MTPAdapter:
    """A model's adapter with the multi-token prediction depths (`mtp`) and a copy of the embedding on
    the last stage; its loss is the main loss plus the depths' weighted losses (models/mtp.py)."""

    def __init__(self, base: PipelineAdapter, weight: float, loss_chunk: int = 0):
        self.base, self.weight, self.loss_chunk = base, weight, loss_chunk
        self.layers, self.first = base.layers, base.first
        self.last = (*base.last, *(n for n in base.first if n not in base.last), "mtp")

    def tied(self, model: nn.Module) -> dict[str, str]:
        return self.base.tied(model)

    def shared(self, model: nn.Module) -> list[str]:
        """Global names of the trainable weights held whole by both ends: the first stage's modules."""
        return [f"{n}.{p}" for n in self.first for p, q in getattr(model, n).named_parameters() if q.requires_grad]

    def embed(self, module: nn.Module, tokens_bs: torch.Tensor) -> torch.Tensor:
        return self.base.embed(module, tokens_bs)

    def head_loss(self, module: nn.Module, x_bsh: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        loss = self.base.head_loss(module, x_bsh, targets_bs)
        extra = mtp_loss(module.mtp, module.embed, module.head, module.loss, x_bsh, targets_bs, self.weight,
                         self.loss_chunk)
        return loss if extra is None else loss + extra

    def activation_shape(self, model_cfg, tokens_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.base.activation_shape(model_cfg, tokens_shape)
