"""Building a model without storage (`torch.device("meta")`) and without its random fills.

A module's constructor fills its weights (`reset_parameters`: `nn.init.normal_`, `uniform_`, ...). On
meta tensors those fills produce nothing, yet a meta `normal_` runs torch's Python reference through a
wrapper that imports torch._dynamo at its first call (~2 CPU-s in a process that builds no optimizer:
`ckpt export`, the parameter count) and costs each build ~0.1 CPU-s more (a 4-rank tiny run's Trainer
build: 0.87 -> 0.64 CPU-s). The values come later, when each rank materialises its part and
initialises it (models/decoder.py `init_parameters`, a Hugging Face directory's weights).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

# in-place random fills of torch.nn.init and the Tensor methods they call
FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
                   "xavier_uniform_", "orthogonal_", "sparse_", "exponential_", "geometric_", "log_normal_",
                   "cauchy_", "random_", "bernoulli_"})


class _SkipMetaFills(TorchFunctionMode):
    """Returns a meta tensor's random fill unchanged (there is nothing to fill); everything else runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in FILLS:
            target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """`with on_meta(): model = build()`: torch.device("meta") for every tensor created inside, the random
    fills of meta tensors skipped."""
    with torch.device("meta"), _SkipMetaFills():
        yield
