"""Pipeline parallelism: stages over the "pp" axis, one runtime running a schedule (threefold.schedules:
schedules as data), the simulator and the pictures.

`split_pipeline` (split.py) is step 2 of `parallelize()`: it keeps this rank's stages of the
model and prepares the schedule; `PipelineSplit.runtime` then builds the interpreter once the
gradient sync over dp exists. See docs/pipeline.md. The names below load on first use, so
`threefold schedule` (simulation, pictures) starts without importing torch.
"""

from __future__ import annotations

import importlib

__all__ = ["PipelineSplit", "split_pipeline", "plan_stages", "PipelineRuntime"]
_HOMES = {"PipelineRuntime": ".runtime"}


def __getattr__(name: str):
    if name not in __all__:  # e.g. a submodule not imported yet: `from threefold.pipeline import draw`
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES.get(name, ".split"), __name__), name)
