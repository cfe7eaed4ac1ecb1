"""The host's floor under a step: PyTorch eager issues every operator from the CPU.

A GPU runs a kernel only after the host dispatched it (Python, the dispatcher, the CUDA launch).
When the kernels are large the host runs ahead and this costs nothing; when they are small (a tiny
model, a micro-batch of one short sequence) the GPU waits for the host and the step takes about
(operators issued) x (seconds per operator), however few FLOPs it does. Without this floor a
35k-parameter model was predicted at 1.6e10 tokens/s on 8 GPUs.

Operator counts are those of threefold's own blocks, counted with a TorchDispatchMode over one
forward and one backward (tests/unit/test_plan_dispatch.py keeps them within 40% of the count):
a dense GPT-2 block (layer norm, GELU, learned positions) issues 39 operators forward and 94
backward; RMSNorm adds 12 / 30, rotary positions 28 / 30, SwiGLU 5 / 15; a mixture-of-experts block ~160 / 186, its experts one grouped
(or padded batched) matmul whatever their number (models/moe.py; the per-expert loop that a lopsided
batch falls back to adds 12 / 31 per expert, which the planner's balanced routing does not reach); the embedding, final norm, head and loss ~22 / 30. The optimizer's foreach
kernels and the gradient clip add ~16 launches per step.
The seconds per operator (`Gpu.op_overhead_s`, 4 us) is PyTorch's eager dispatch (1.8 us for a
one-element add measured on a 2-core x86 host with torch 2.13) plus a CUDA launch (2-4 us, NVIDIA's
"Getting Started with CUDA Graphs" measures 3.8 us per back-to-back short kernel); CUDA graphs
or a compiled step lower it, which `--gpu FILE.toml` can state with `op_overhead_us`.
"""

from __future__ import annotations

from ..config import ModelConfig

DENSE_BLOCK_OPS = (39, 94)  # (forward, backward) operators of a GPT-2 block ...
RMSNORM_OPS, ROPE_OPS, SWIGLU_OPS = (12, 30), (28, 30), (5, 15)  # ... and what each variant adds
SPARSE_BLOCK_OPS = (160, 186)  # a mixture-of-experts block: router, dispatch, the experts' grouped matmul, combine ...
PER_EXPERT_OPS = (0, 0)  # ... and nothing per expert held by this rank (the grouped matmul takes them all)
ENDS_OPS = (22, 30)  # embedding + final norm, head and loss (split between the first and last stage)
OPTIMIZER_OPS = 16  # foreach AdamW and the global-norm clip, per step


def dense_block_ops(m: ModelConfig) -> tuple[int, int]:
    """(forward, backward) operators of one dense block of `m`."""
    extras = [RMSNORM_OPS] * (m.norm == "rmsnorm") + [ROPE_OPS] * (m.position == "rope") + [SWIGLU_OPS] * (m.mlp == "swiglu")
    return DENSE_BLOCK_OPS[0] + sum(e[0] for e in extras), DENSE_BLOCK_OPS[1] + sum(e[1] for e in extras)


def stage_ops(m: ModelConfig, layers: int, sparse: int, local_experts: int, first: bool, last: bool) -> tuple[int, int]:
    """(forward, backward) operators one micro-batch issues on a stage of `layers` blocks, `sparse` of
    them mixtures of experts holding `local_experts` experts each."""
    dense_f, dense_b = dense_block_ops(m)
    fwd = (layers - sparse) * dense_f + sparse * (SPARSE_BLOCK_OPS[0] + local_experts * PER_EXPERT_OPS[0])
    bwd = (layers - sparse) * dense_b + sparse * (SPARSE_BLOCK_OPS[1] + local_experts * PER_EXPERT_OPS[1])
    if first:
        fwd, bwd = fwd + ENDS_OPS[0] // 4, bwd + ENDS_OPS[1] // 4
    if last:
        fwd, bwd = fwd + ENDS_OPS[0] - ENDS_OPS[0] // 4, bwd + ENDS_OPS[1] - ENDS_OPS[1] // 4
    return fwd, bwd
