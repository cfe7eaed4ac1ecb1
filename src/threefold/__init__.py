"""threefold: data, tensor and pipeline parallel training of large PyTorch models."""

from .config import Config, load_config
from .errors import ConfigError, UserError
from .mesh import Layout, Mesh

__version__ = "0.1.0"

__all__ = ["Config", "load_config", "ConfigError", "UserError", "Layout", "Mesh", "__version__"]
