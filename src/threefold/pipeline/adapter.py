"""What the pipeline needs to know about a model: its layer list and its two ends.

No graph tracer: a model is cut between the layers of one list, with the modules before the
list (embedding) on the first stage and the modules after it (final norm, head, loss) on the
last. The adapter that names those parts and runs them is part of the model's contract
(`ModelSpec.adapter`, models/spec.py); every family in models/ has the same shape
(`CausalAdapter`).
"""

from __future__ import annotations

from torch import nn

from ..models.spec import CausalAdapter, PipelineAdapter

__all__ = ["CausalAdapter", "DecoderAdapter", "PipelineAdapter"]


class DecoderAdapter(CausalAdapter):
    """The reference decoder's adapter, reading its tie from the model (for code holding only the module)."""

    def tied(self, model: nn.Module) -> dict[str, str]:
        return {"head.weight": "embed.tok.weight"} if model.cfg.tie_embeddings else {}
