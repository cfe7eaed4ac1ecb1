"""Token sources and the layout-independent sampler."""

from .sampler import Batch, Sampler
from .sources import load_tokens

__all__ = ["Batch", "Sampler", "load_tokens"]
