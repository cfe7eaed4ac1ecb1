"""`train.compile`: torch.compile per region - each block, and each other top-level module.

Without a pipeline the rank's model is compiled region by region, in place (step 6 of
`parallelize`), as torchtitan compiles a transformer: every item of the layer list (`blocks.<i>`,
the units ZeRO-3 gathers) is one region, and so is every other top-level module (`embed`, `norm`,
`head`, `loss`). A region is the module's `forward`, replaced on the instance by its compiled
form (`torch.compile(module.forward)`, static shapes); AOT autograd compiles its backward with it,
so each region's backward is one autograd node of its own. Parameter names, hooks and the module
tree are unchanged, so checkpoints, the tensor plan and the gradient sync see the same model.

Why per region and not the whole model: a compiled region's backward is one node, and a
parameter's gradient is accumulated - its post-accumulate-grad hook fires - only when the node
that produces it has finished. With the whole forward as one region every gradient hook (plain
dp's buckets, ZeRO-1/2's bucket reduce-scatters, ZeRO-3's per-unit reduce-scatter) fired after
the whole backward, so no communication overlapped it. Per region, the head's and the last
blocks' gradients are complete while the earlier blocks' backward still runs, and their buckets
are issued then (tests/distributed/test_compile.py records the order). The blocks share one
compiled graph (the same code and structure; dynamo makes the parameters graph inputs), so
compilation time does not grow with the depth; the code between regions (the loop over the
blocks, the routers' auxiliary losses) stays eager, a few Python calls per block.

Under a pipeline each stage's computation (`ModuleCompute.run_stage`: its embedding, layers,
and head and loss) is one region (`stage_compiler`); the schedule, the transfers between
stages and the split backward stay eager around it.

What a region contains besides the model's own code, and what stays outside:
* a region's own module hooks run eagerly around it (the compiled function is the `forward`, not
  `__call__`): ZeRO-3's gather before a unit and its free after it, tensor parallelism's region
  hooks, the debug tools' hooks. Hooks of modules inside a region are traced with it: ZeRO-1/2's
  wait for a segment's parameter all-gather is one graph break (`Handle.wait`);
* every collective issued inside (tensor and sequence parallelism's conjugate pairs, ZeRO-3's
  gathers, the experts' all-to-all) runs eagerly through `Comm`, one graph break each
  (comm/tracing.py), so its bytes are counted and recorded as without compile;
* gradient hooks (plain dp's bucketed all-reduce, ZeRO's reduce-scatter) fire from autograd's
  accumulation of the parameters' gradients, after the backward node of the region that
  produced them, while the backward of the regions before it runs next;
* the activation meter's saved-tensor hooks are entered around the model's call: they see what
  the compiled graphs save for backward;
* the optimizer step is not compiled (docs/gpu.md: on CUDA it is already fused AdamW, one kernel).

Shapes are static (`dynamic=False`): every micro-batch of a run has the same shape. The graphs
and breaks per layout, as dynamo counts them, are in docs/gpu.md (bench/compile_breaks.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..comm.tracing import keep_collectives_eager
from .sequence_region import keep_regather_eager

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def keep_eager() -> None:
    """What torch.compile must never trace: Comm's collectives and waits, and the sequence-parallel
    regather issued at a region's backward start (each call one graph break, run eagerly)."""
    keep_collectives_eager()
    keep_regather_eager()


def compile_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The regions `train.compile` compiles: every item of a top-level ModuleList/Sequential/
    ModuleDict (the blocks) and every other top-level module, each once, in registration order."""
    found, seen = [], set()
    for name, child in model.named_children():
        items = ([(f"{name}.{n}", c) for n, c in child.named_children()] if isinstance(child, CONTAINERS)
                 else [(name, child)])
        for item_name, item in items:
            if id(item) not in seen:
                seen.add(id(item))
                found.append((item_name, item))
    return found


def apply_compile(model: nn.Module, enabled: bool, backend: str = "inductor", pipelined: bool = False) -> list[str]:
    """Compile `model` region by region in place when `enabled` (not under a pipeline: its stages
    are compiled by `stage_compiler`); returns the names of the compiled regions. `enabled` is
    `train.compile` settled for the device (`Config.for_device`); `auto` not settled stays eager."""
    if enabled is not True or pipelined:
        return []
    keep_eager()
    regions = compile_regions(model)
    for _, module in regions:
        # the instance's forward (remat's checkpointed wrapper where there is one), not __call__:
        # the module's own hooks stay eager around the region
        module.forward = torch.compile(module.forward, backend=backend, dynamic=False)
    return [name for name, _ in regions]


def stage_compiler(enabled: bool, backend: str = "inductor") -> Callable[[Callable], Callable] | None:
    """What compiles a pipeline stage's computation (`train.compile`), or None when off (or not settled)."""
    if enabled is not True:
        return None

    def compile_stage(fn: Callable) -> Callable:
        keep_eager()
        return torch.compile(fn, backend=backend, dynamic=False)
    return compile_stage
