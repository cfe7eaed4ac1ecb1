"""`train.compile`: torch.compile of the whole forward and loss, one region per model or stage.

Without a pipeline the rank's model is compiled in place (`nn.Module.compile`, step 6 of
`parallelize`): one region from the token ids to the summed token loss - embedding, blocks,
final norm, head and loss - whose backward AOT autograd compiles with it. Parameter names,
hooks and the module tree are unchanged, so checkpoints, the tensor plan and the gradient sync
see the same model. Under a pipeline each stage's computation (`ModuleCompute.run_stage`: its
embedding, layers, and head and loss) is one region (`stage_compiler`); the schedule, the
transfers between stages and the split backward stay eager around it.

What the region contains besides the model's own code, and what stays outside:
* module hooks of the strategies run inside and are traced: ZeRO-1/2's wait for the parameter
  all-gather (one graph break per segment, at `Handle.wait`), ZeRO-3's gather before a unit and
  its free after it (one break at the gather, one at each wait);
* every collective issued inside (tensor and sequence parallelism's conjugate pairs, ZeRO-3's
  gathers, the experts' all-to-all) runs eagerly through `Comm`, one graph break each
  (comm/tracing.py), so its bytes are counted and recorded as without compile;
* gradient hooks (plain dp's bucketed all-reduce, ZeRO's reduce-scatter) fire from autograd's
  accumulation of the parameters' gradients, after the compiled backward: outside;
* the activation meter's saved-tensor hooks are entered around the compiled call: they see what
  the compiled graph saves for backward;
* the optimizer step is not compiled (docs/gpu.md: on CUDA it is already fused AdamW, one kernel).

Shapes are static (`dynamic=False`): every micro-batch of a run has the same shape. The breaks
per layout, as dynamo counts them, are in docs/gpu.md (bench/compile_breaks.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..comm.tracing import keep_collectives_eager


def apply_compile(model: nn.Module, enabled: bool, backend: str = "inductor", pipelined: bool = False) -> bool:
    """Compile `model`'s whole forward in place when `enabled` (not under a pipeline: its stages are
    compiled by `stage_compiler`); returns whether it did."""
    if not enabled or pipelined:
        return False
    keep_collectives_eager()
    model.compile(backend=backend, dynamic=False)
    return True


def stage_compiler(enabled: bool, backend: str = "inductor") -> Callable[[Callable], Callable] | None:
    """What compiles a pipeline stage's computation (`train.compile`), or None when off."""
    if not enabled:
        return None

    def compile_stage(fn: Callable) -> Callable:
        keep_collectives_eager()
        return torch.compile(fn, backend=backend, dynamic=False)
    return compile_stage
