"""`train.compile`: torch.compile of every transformer block this rank holds (step 6 of `parallelize`).

Each block is compiled in place (`nn.Module.compile`): parameter names, hooks and the module tree
are unchanged, so checkpoints, the tensor plan, the pipeline split and the gradient sync see the
same model. The compiled call covers the block's hooks and checkpointed regions as well; what
dynamo cannot trace (a collective issued through `Comm` inside a tensor-parallel region or a
ZeRO-3 gather hook) becomes a graph break, and the pieces between breaks are still compiled.
The breaks, as `torch._dynamo.explain` lists them, are in docs/gpu.md. Shapes are static
(`dynamic=False`): every micro-batch of a run has the same shape.
"""

from __future__ import annotations

from torch import nn

from .remat import blocks_of


def apply_compile(model: nn.Module, enabled: bool, backend: str = "inductor") -> list[str]:
    """Compile each block of `model` in place when `enabled`; returns their names."""
    if not enabled:
        return []
    names = []
    for _, name, block in blocks_of(model):
        block.compile(backend=backend, dynamic=False)
        names.append(name)
    return names
