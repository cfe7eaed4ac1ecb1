"""MXFP8 in the plan (`threefold plan --precision mxfp8`, docs/fp8.md "MXFP8", parallel/mxfp8.py).

Where it runs natively: tensor cores that take block scales are Blackwell's (compute capability 10.0,
what the runtime's `hardware_mx` asks): NVIDIA's Blackwell architecture introduces the OCP microscaling
formats (MXFP8, MXFP6, MXFP4) in its fifth-generation tensor cores, and its data sheets give MXFP8 the
dense FP8 peak (B200 4.5 PFLOP/s). Hopper's fourth-generation tensor cores (H100, H200, H800) take one
fp32 scale per operand (tensorwise or rowwise fp8), not one per 32 elements: there, as on an A100 and
a CPU, torchao runs MXFP8 emulated (a matmul of the dequantised operands), slower than bf16, and the
auto rule (`precision.fp8_linears=auto`) converts no linear - so a plan there is bf16's, and says why.

A converted linear on Blackwell: its three GEMMs (output, input gradient, weight gradient) at the fp8
peak, shaped and priced as the tensorwise cuBLAS kernel (compute.py `_fp8_gemm_seconds`: 1-byte operands,
bf16 output; the GEMM's reads of the e8m0 scales, 1/32 of its operand bytes, are left out); and the casts: each operand (x, W, dY) cast in the two
layouts its GEMMs block it along (x along K and along M, ...), each cast reading the bf16 operand twice
(the block's amax, then the cast) and writing the fp8 element and its share of the scale - 2 (2 + 2 + 1
+ 1/32) bytes per operand element - in 18 kernels (amax, scale and cast per operand and layout, as the
rowwise recipe), each at least the launch gap. No amax all-reduce under tp: a block never spans ranks.
The first and last block stay bf16 (`precision.fp8_skip_first_last`), the head and embedding too.

Memory: the weights and the saved activations are bf16's (the linears save the bf16 input and weight
and cast again in backward, parallel/mxfp8.py `save_matmul_operands`); on a GPU the transient holds the
largest converted GEMM's two cast operands, 33/32 bytes an element (fp8 and the e8m0 scales).
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from .compute import _fp8_gemm_seconds, bf16_linear_seconds, block_linear_shapes, gemm_seconds
from .hardware import Gpu

BLOCK = 32  # elements per e8m0 scale (OCP MX: k = 32; parallel/mxfp8.py BLOCK)
ELEMENT_BYTES = 1 + 1 / BLOCK  # an e4m3 element and its share of the block's scale
CAST_BYTES = 2 * (2 + 2 + ELEMENT_BYTES)  # per operand element: two layouts, each two bf16 reads and the writes
CAST_KERNELS = 18  # amax, scale and cast per operand and layout
MX_KINDS = ("b100", "b200", "b300")  # Blackwell data-centre kinds (compute capability 10.x): MX tensor cores


def mx_native(gpu: Gpu) -> bool:
    """Whether `gpu` has tensor cores that take MX block scales (Blackwell), by its kind's name."""
    return gpu.fp8_flops > 0 and any(kind in gpu.name.lower() for kind in MX_KINDS)


def misfit(k: int, n: int) -> bool:
    """A GEMM whose K or N is no multiple of the block stays bf16 (parallel/mxfp8.py `misfit`)."""
    return bool(k % BLOCK or n % BLOCK)


def mx_linear_seconds(m: int, k: int, n: int, gpu: Gpu) -> float:
    """Forward + backward of a linear x[m,k] W^T[k,n] in MXFP8 with its casts; infinite where not native."""
    if not mx_native(gpu):
        return math.inf
    gemms = sum(_fp8_gemm_seconds(a, b, c, gpu, "tensorwise") for a, b, c in ((m, n, k), (m, k, n), (k, n, m)))
    casts = CAST_BYTES * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s
    return gemms + casts + CAST_KERNELS * gpu.op_overhead_s


def mx_gains(m: int, k: int, n: int, gpu: Gpu) -> bool:
    """The auto rule for mxfp8: native MX, whole blocks, and faster than the linear's bf16 GEMMs."""
    return not misfit(k, n) and mx_linear_seconds(m, k, n, gpu) < bf16_linear_seconds(m, k, n, gpu)


def converted(model: ModelConfig, rows: int, tp: int, gpu: Gpu) -> dict[str, tuple[int, int, int]]:
    """The block linears (M, K, N on a tp rank, compute.py `block_linear_shapes`) the auto rule converts."""
    return {name: s for name, s in block_linear_shapes(model, rows, tp).items() if mx_gains(*s, gpu)}


def block_saving_seconds(model: ModelConfig, rows: int, tp: int, gpu: Gpu) -> float:
    """Kernel seconds one block's forward saves against bf16: each converted linear charged a third of its
    MXFP8 forward + backward in place of its bf16 forward GEMM (the step model's backward is twice the
    forward, as for every linear); `compute_efficiency` not applied."""
    return sum(gemm_seconds(m, n, k, gpu) - mx_linear_seconds(m, k, n, gpu) / 3
               for m, k, n in converted(model, rows, tp, gpu).values())


def cast_transient_bytes(model: ModelConfig, rows: int, tp: int, gpu: Gpu) -> float:
    """The largest converted GEMM's two cast operands (fp8 and scales) alive at once."""
    sizes = [max(m * k + n * k, m * n + n * k, n * m + k * m) for m, k, n in converted(model, rows, tp, gpu).values()]
    return ELEMENT_BYTES * max(sizes, default=0)


def advice(model: ModelConfig, rows: int, tp: int, gpu: Gpu, layout: str) -> dict:
    """Which block linears the auto rule converts under a layout, each one's modelled speedup, one line."""
    linears = {}
    for name, (m, k, n) in block_linear_shapes(model, rows, tp).items():
        mx = mx_linear_seconds(m, k, n, gpu)
        linears[name] = {"m": m, "k": k, "n": n, "speedup": 0.0 if math.isinf(mx) else
                         round(bf16_linear_seconds(m, k, n, gpu) / mx, 3), "mxfp8": mx_gains(m, k, n, gpu)}
    gaining = [name for name, v in linears.items() if v["mxfp8"]]
    why = "" if mx_native(gpu) else (f" ({gpu.name} has no MX tensor cores: MXFP8 runs emulated there, slower than "
                                     "bf16, and the plan is bf16's)")
    line = (f"mxfp8 ({layout}): {len(gaining)} of {len(linears)} block linears gain on {gpu.name}"
            + (f" ({', '.join(gaining)})" if gaining else "") + "; the first and last block and the head stay bf16"
            + why)
    return {"layout": layout, "native": mx_native(gpu), "linears": linears, "gaining": gaining, "line": line}


def whole_blocks(model: ModelConfig, tp: int) -> bool:
    """Whether tp leaves every rank whole 32-element blocks (parallel/mxfp8.py `refusal`; else the run is refused)."""
    dims = [model.attn_width, model.ffn_hidden] + ([model.kv_heads * model.head_dim] if model.kv_heads % tp == 0 else [])
    return tp == 1 or all(d % tp == 0 and (d // tp) % BLOCK == 0 for d in dims)
