"""How ZeRO-3 (zero3.py) cuts a model into units, and the tensors of a module's output."""

from __future__ import annotations

import torch
from torch import nn


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children with parameters; the items of a ModuleList/Sequential/ModuleDict are units each."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            out += [(f"{name}.{n}", c) for n, c in child.named_children() if next(c.parameters(), None) is not None]
        elif next(child.parameters(), None) is not None:
            out.append((name, child))
    return out


def tensors(output) -> list[torch.Tensor]:
    """Every tensor in a module's output (nested tuples, lists and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in tensors(item)]
    return []
