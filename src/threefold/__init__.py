"""threefold: data, tensor and pipeline parallel training of large PyTorch models."""

from .config import Config, load_config
from .errors import ConfigError, UserError

__version__ = "0.1.0"

__all__ = ["Config", "load_config", "ConfigError", "UserError", "Layout", "Mesh", "prepare", "__version__"]


def __getattr__(name: str):
    """`Layout`, `Mesh` and `prepare` import torch: only when asked for (the command line starts without it)."""
    if name == "prepare":
        from .engine import prepare

        return prepare
    if name in ("Layout", "Mesh"):
        from . import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'threefold' has no attribute {name!r}")
