"""Configuration: typed sections (sections.py), read from TOML plus overrides (load.py), checked as a
whole (checks.py, moe_checks.py), the elastic layout rules (elastic.py) and the Hugging Face
config.json reader (hf.py). `threefold.config` is the face: `Config`, `load_config`, the sections."""

from .load import *  # noqa: F401,F403
from .load import __all__  # noqa: F401
