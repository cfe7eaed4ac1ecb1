"""Activation checkpointing: keep fewer activations for backward, recompute the rest.

Step 3 of `parallelize`. A checkpointed region runs its forward without saving anything for
backward but its inputs; when backward reaches it, the region's forward runs again
(torch.utils.checkpoint, non-reentrant) and its backward proceeds from the recomputed tensors.
Policies (`remat.policy`):

    none        save everything (fastest, most memory)
    full        every transformer block (`blocks.<i>`) is a region: only block inputs are kept
    every-k     blocks whose index is a multiple of `remat.every` are regions
    selective   only the named parts of each block (`remat.targets`; by default the family's own,
                `ModelSpec.selective`: the reference decoder's `attn.core`, the softmax attention whose
                saved state grows with seq_len^2 but is cheap to redo; a Hugging Face model's attention
                module)

Results are bit-identical to no checkpointing: the recomputation repeats the same kernels on
the same inputs (and the RNG state is restored for it).

Regions are found by name (the model contract: blocks.<i>, blocks.<i>.attn, ...), and wrapped
from outside by replacing the module's `forward` (or the named method) on the instance, so
module hooks of later strategies (ZeRO-3's gather/free) still run around the whole region.
"""

from __future__ import annotations

import functools
import re
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import RematConfig
from ..errors import ConfigError
from ..models.forwards import recomputing

BLOCK = re.compile(r"(?:.*\.)?blocks\.(\d+)")
_WRAPPED: weakref.WeakSet = weakref.WeakSet()  # the regions' wrappers, so a region is never wrapped twice


def checkpointed(fn):
    """`fn` as a checkpointed region (a no-op wrapper when autograd is off)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        # non-reentrant: the inputs are saved through autograd's saved-tensor mechanism (so
        # activation accounting sees exactly what is kept), and the region may use autograd
        # hooks of other strategies (ZeRO-3) during the recomputation
        return checkpoint(_marking_recomputation(fn), *args, use_reentrant=False, **kwargs)

    _WRAPPED.add(run)
    return run


def _marking_recomputation(fn):
    """`fn` whose second and later runs (the recomputations) run inside models.forwards.recomputing(),
    so modules with side effects (the router's tally) do not count them again."""
    runs = 0

    def region(*args, **kwargs):
        nonlocal runs
        if torch.compiler.is_compiling():  # traced once; the compiled backward recomputes without Python
            return fn(*args, **kwargs)
        runs += 1
        if runs == 1:
            return fn(*args, **kwargs)
        with recomputing():
            return fn(*args, **kwargs)

    return region


def blocks_of(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer index, name, module) of every transformer block, in order."""
    out = []
    for name, module in model.named_modules():
        match = BLOCK.fullmatch(name)
        if match:
            out.append((int(match.group(1)), name, module))
    return sorted(out, key=lambda t: t[0])


def _wrap_forward(module: nn.Module) -> None:
    if module.forward not in _WRAPPED:
        module.forward = checkpointed(module.forward)


def block_parts(block: nn.Module, depth: int = 2) -> list[str]:
    """The names a selective target can take in `block`: its submodules down to `depth` levels."""
    return [name for name, _ in block.named_modules() if name and name.count(".") < depth]


def _wrap_target(block_name: str, block: nn.Module, target: str) -> str:
    """Wrap `target` (a submodule path or `path.method`) inside `block`; returns its full name."""
    full = f"{block_name}.{target}"
    try:
        module = block.get_submodule(target)
        _wrap_forward(module)
        return full
    except AttributeError:
        pass
    owner_path, _, method = target.rpartition(".")
    try:
        owner = block.get_submodule(owner_path) if owner_path else block
    except AttributeError:
        owner = None
    fn = getattr(owner, method, None) if owner is not None else None
    if not callable(fn) or isinstance(fn, nn.Module):
        parts = ", ".join(block_parts(block))
        raise ConfigError("remat.targets", f"'{target}' is neither a submodule nor a method of {block_name}; "
                          f"name parts of this model's blocks: {parts}")
    if fn not in _WRAPPED:
        setattr(owner, method, checkpointed(fn))
    return full


def apply_remat(model: nn.Module, cfg: RematConfig, family_targets: tuple[str, ...] = ("attn.core",)) -> list[str]:
    """Wrap the regions `cfg.policy` selects; returns their names. `family_targets`: what selective
    recomputes when remat.targets is empty (the model family's ModelSpec.selective)."""
    if cfg.policy == "none":
        return []
    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError("remat.policy", f"'{cfg.policy}' needs transformer blocks named blocks.<i>; "
                          "this model has none (use remat.policy=none)")
    regions = []
    if cfg.policy in ("full", "every-k"):
        for index, name, block in blocks:
            if cfg.policy == "full" or index % cfg.every == 0:
                _wrap_forward(block)
                regions.append(name)
    elif cfg.policy == "selective":
        targets = [t.strip() for t in cfg.targets.split(",") if t.strip()] or list(family_targets)
        for _, name, block in blocks:
            regions += [_wrap_target(name, block, t) for t in targets]
    return regions
