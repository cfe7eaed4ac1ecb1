"""FP8 training of the blocks' linears (`precision.compute=fp8`, docs/fp8.md).

Each converted linear runs its three matmuls (output, input gradient, weight gradient) on float8
operands with dynamic scaling: every operand is cast with a scale from its current absolute maximum
(`amax`), `scale = finfo(fp8).max / amax`, so the largest value lands on the format's largest, and
the product is divided by both scales again. The recipes are torchao's (`Float8LinearRecipeName`):

    tensorwise   one scale per tensor; inputs and weights e4m3, output gradients e5m2
    rowwise      one scale per row of each GEMM operand (along the contracted dimension), all e4m3,
                 scales rounded down to a power of 2

The casts and the scaled matmul are torchao's own (`torchao.float8`): `amax_to_scale`,
`hp_tensor_and_scale_to_float8` and its `Float8TrainingTensor`, whose `torch.mm` is
`torch._scaled_mm` on a GPU with fp8 tensor cores and, with `emulate`, a plain fp32 matmul of the
dequantised operands (every other device: CPU tests run the same quantisation). What threefold adds
is the autograd function around them, `Fp8Matmul`, because torchao's `Float8Linear` computes every
amax over the local tensor only (its reduction is tied to DTensor, which threefold's tensor
parallelism does not use): here an amax over a dimension that tensor parallelism splits is reduced
(MAX) over tp through `Comm` (bytes under `all_reduce.fp8_amax`), so a sharded weight, a
column-parallel output gradient or a row-parallel input is scaled exactly as the whole tensor is
on one device, and tp=2 quantises to the same fp8 values as tp=1.

Which linears convert: those inside `blocks.<i>`, the stacked experts' matmuls among them (never
the embedding, the head or a router), not
the first and last block with `precision.fp8_skip_first_last`, and with `precision.fp8_linears=auto`
only those whose GEMM shape gains on this device (`planner.compute.fp8_gains`: the per-GPU ratios
of fp8 to bf16 GEMM time, cast overheads included; no gain anywhere without fp8 tensor cores). LoRA's
adapters (`lora_A` / `lora_B`, parallel/lora.py) never convert: they are the trained weights, and their
low-rank GEMMs stay in the compute precision (bf16); the base linear they sit beside may convert, in
place, keeping its adapters and their forward hook. The parameters stay what they were (bf16 compute
copies of fp32 masters): checkpoints hold no fp8 state, since dynamic scaling keeps none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm
from ..config import PrecisionConfig
from ..models.moe import Experts
from ..errors import ConfigError
from .lora import is_adapter_module
from .mxfp8 import MxKernel, hardware_mx, misfit, quiet_torchao, save_matmul_operands, saved_matmul_operands
from .tensor import AXIS, ColumnParallelLinear, RowParallelLinear

Sharded = Literal["in", "out"] | None
BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _torchao_float8():
    """torchao.float8's pieces, imported once they are needed (its import noise silenced)."""
    with quiet_torchao():
        from torchao.float8.float8_training_tensor import (Float8TrainingTensor, GemmInputRole, LinearMMConfig,
                                                           ScaledMMConfig, hp_tensor_and_scale_to_float8)
        from torchao.float8.float8_utils import amax_to_scale
    return (GemmInputRole, LinearMMConfig, ScaledMMConfig, hp_tensor_and_scale_to_float8, amax_to_scale,
            Float8TrainingTensor)


@dataclass(frozen=True)
class Fp8Recipe:
    """Formats and granularity of the three operands (torchao's recipes of the same names)."""

    name: str
    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype
    rowwise: bool
    pow2_scales: bool

    @staticmethod
    def named(name: str) -> "Fp8Recipe":
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        if name == "tensorwise":
            return Fp8Recipe(name, e4, e4, e5, rowwise=False, pow2_scales=False)
        if name == "rowwise":
            return Fp8Recipe(name, e4, e4, e4, rowwise=True, pow2_scales=True)
        raise ValueError(f"unknown fp8 recipe {name!r}")


def hardware_fp8(device: torch.device) -> bool:
    """True where `torch._scaled_mm` runs on fp8 tensor cores (CUDA compute capability 8.9 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Kernel:
    """The fp8 matmul of one linear: its recipe, whether its GEMMs are emulated, and which feature
    dimension tensor parallelism splits (`in`: a row-parallel weight's inputs, `out`: a
    column-parallel one's outputs), whose amaxes are then reduced over tp."""

    def __init__(self, recipe: Fp8Recipe, emulate: bool, comm: Comm | None = None, sharded: Sharded = None):
        (self._role, LinearMMConfig, ScaledMMConfig, self._to_fp8, self._amax_to_scale,
         self._fp8_tensor) = _torchao_float8()
        self.recipe, self.emulate, self.comm, self.sharded = recipe, emulate, comm, sharded
        # the weight's fp8 form as ZeRO-3's fp8 gather delivered it (`take_weight`): (weight, bits, scale)
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # output GEMM with fast accumulation, the gradients' without (torchao's defaults)
        self.mm_config = LinearMMConfig(ScaledMMConfig(emulate, True, False, False),
                                        ScaledMMConfig(emulate, False, False, False),
                                        ScaledMMConfig(emulate, False, False, False))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 shard: tuple[torch.Tensor, object] | None = None) -> torch.Tensor:
        """y = x W^T + b with fp8 GEMMs; `shard`: (the region's sequence shard of x, its regatherer)
        under sequence parallelism, saved instead of x and gathered again in backward."""
        y = Fp8Matmul.apply(x, weight, self, shard)
        return y if bias is None else y + bias.to(y.dtype)

    # ---- the weight pre-cast by ZeRO-3's gather (parallel/zero3.py `MatmulCast`, tensorwise only)
    @property
    def takes_cast_weights(self) -> bool:
        """Tensorwise: the weight has one fp8 form, the same in all three GEMMs, so a gather can deliver it."""
        return not self.recipe.rowwise

    def weight_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The weight's scale from its amax over the gathered axis (fp32), reduced over tp as `cast` does."""
        amax = amax.float().reshape(())
        if self.sharded and self.comm is not None and self.comm.mesh.size(AXIS) > 1:
            amax = amax.contiguous()
            self.comm.all_reduce(amax, AXIS, op=dist.ReduceOp.MAX, tag="fp8_amax")
        return self._amax_to_scale(amax, self.recipe.weight_dtype, self.recipe.pow2_scales)

    def weight_bits(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`values` (any part of the weight) in fp8 at `scale`, bit for bit as `cast` makes them."""
        return self._to_fp8(values, scale, self.recipe.weight_dtype, self.mm_config, self._role.WEIGHT, None)._data

    def take_weight(self, weight: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor) -> None:
        """Use `bits` (the whole weight's fp8, `weight`'s shape) at `scale` as `weight`'s fp8 operand until
        `drop_weight`: the matmuls do not cast the weight again."""
        self.gathered = (weight, bits, scale)

    def drop_weight(self) -> None:
        self.gathered = None

    def _weight_t(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        """W^T ("KN") in fp8: the gathered form when it is this weight's, else cast now."""
        got = self.gathered
        if got is not None and got[0] is weight:
            return self._fp8_tensor(got[1], got[2], weight.dtype, self.mm_config, self._role.WEIGHT, None).t()
        return self.cast(weight.t(), self.recipe.weight_dtype, self._role.WEIGHT, "KN", dim)

    # ---- casting
    def cast(self, t: torch.Tensor, dtype: torch.dtype, role, dims: str, dim: int | None) -> torch.Tensor:
        """`t` (2-D, its dimensions named by `dims`, e.g. "MK") as a float8 tensor scaled over
        `dim` (None: the whole tensor), the amax reduced over tp when the scaled-over dimension is
        the one tp splits."""
        rowwise = self.recipe.rowwise
        if rowwise:
            amax = t.abs().amax(dim=dim, keepdim=True)
        else:
            amax = t.abs().amax()
        over = dims if not rowwise else dims[dim]
        feature = {"in": "K", "out": "N"}.get(self.sharded or "", "")
        if feature and feature in over and self.comm is not None and self.comm.mesh.size(AXIS) > 1:
            amax = amax.float().contiguous()
            self.comm.all_reduce(amax, AXIS, op=dist.ReduceOp.MAX, tag="fp8_amax")
        scale = self._amax_to_scale(amax, dtype, self.recipe.pow2_scales)
        return self._to_fp8(t, scale, dtype, self.mm_config, role, dim if rowwise else None)


class Fp8Matmul(torch.autograd.Function):
    """x W^T with its three GEMMs in fp8, as torchao's `matmul_with_hp_or_float8_args` computes them:

        output       x[M,K] (scaled per row over K)      @ W^T[K,N] (per column over K)
        grad input   dY[M,N] (per row over N)            @ W[N,K]   (per row of W^T over N)
        grad weight  dY^T[N,M] (per column of dY over M) @ x[M,K]   (per column over M)

    (per row / column: rowwise; tensorwise takes one amax of each operand instead)."""

    @staticmethod
    def forward(ctx, x, weight, kernel: Fp8Kernel, shard):
        r, role = kernel.recipe, kernel._role
        rows = x.reshape(-1, x.shape[-1])
        a = kernel.cast(rows, r.input_dtype, role.INPUT, "MK", -1)
        b = kernel._weight_t(weight, 0)
        y = torch.mm(a, b)
        return save_matmul_operands(ctx, x, weight, kernel, shard, y)

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight, kernel = saved_matmul_operands(ctx)
        r, role = kernel.recipe, kernel._role
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g0 = kernel.cast(g, r.grad_dtype, role.GRAD_OUTPUT, "MN", -1)
            w1 = kernel._weight_t(weight, -1)
            grad_x = torch.mm(g0, w1.t()).reshape(ctx.x_shape)
        x = ctx.regather.gather(saved) if ctx.regather is not None else saved
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1])
            g1 = kernel.cast(g, r.grad_dtype, role.GRAD_OUTPUT, "MN", 0)
            x1 = kernel.cast(rows, r.input_dtype, role.INPUT, "MK", 0)
            grad_w = torch.mm(g1.t(), x1)
        return grad_x, grad_w, None, None


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmul is an `Fp8Kernel` (same parameters, same names)."""

    kernel: Fp8Kernel

    @classmethod
    def convert(cls, linear: nn.Linear, kernel: Fp8Kernel) -> "Fp8Linear":
        """`linear` itself, its class changed (as torch.nn.utils.parametrize does): its parameters, children
        and hooks stay - a LoRA base layer keeps its adapters and the hook that adds them."""
        linear.__class__ = cls
        linear.kernel = kernel
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


# ------------------------------------------------------------------ which linears convert


@dataclass
class Fp8Report:
    """What the conversion did: the converted linears, for each one left in bf16, why, and the LoRA
    adapters' linears (never converted, not counted among the block linears)."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name -> reason
    adapters: list[str] = field(default_factory=list)
    format: str = "fp8"  # or mxfp8 (parallel/mxfp8.py)

    def line(self) -> str:
        reasons: dict[str, int] = {}
        for why in self.kept.values():
            reasons[why] = reasons.get(why, 0) + 1
        kept = "; ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        total = len(self.converted) + len(self.kept)
        return (f"threefold: {self.format}: {len(self.converted)} of {total} block linears compute in {self.format}"
                + (f" (kept in bf16: {kept})" if kept else "")
                + (f"; {len(self.adapters)} LoRA adapter linears stay in bf16" if self.adapters else ""))


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(K, N) of this rank's GEMM, or None for a module that is not a convertible linear."""
    if isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            return None
        rows = module.rows[1] if module.rows is not None else None
        w = module.weight
        k, n = (w.shape[0], w.shape[1]) if module.transposed else (w.shape[1], w.shape[0])
        return k, rows or n
    if isinstance(module, RowParallelLinear):
        w = module.weight
        return (w.shape[0], w.shape[1]) if module.transposed else (w.shape[1], w.shape[0])
    if type(module) is nn.Linear:
        return module.in_features, module.out_features
    if isinstance(module, Experts):  # one expert's up projection stands for its matmuls
        _, f, h = module.w_up.shape
        return h, f
    return None


def convert_linears(model: nn.Module, cfg: PrecisionConfig, comm: Comm | None, device: torch.device, tokens: int,
                    layers: int, global_name: Callable[[str], str] = lambda n: n,
                    gains: Callable[[int, int, int], bool] | None = None, experts_top_k: int = 1,
                    experts_split: int = 1) -> Fp8Report:
    """Give the blocks' linears an fp8 matmul where `cfg` asks (`precision.compute=fp8`), in place.

    `tokens`: the rows M of each linear's GEMM (tokens of a micro-batch on this rank); `layers`: the
    model's block count (first and last by global index; `global_name` maps a local module name to
    its global one under a pipeline split); `gains(M, K, N)`: the auto rule (None: this device has
    no fp8 tensor cores, nothing gains). A block's stacked experts (models/moe.py `Experts`) count as one
    entry, their matmuls all fp8 or all bf16, judged at M = tokens x top-k / (local experts x
    `experts_split`, the ep size). `precision.compute=mxfp8` converts the same linears to MXFP8 matmuls
    (parallel/mxfp8.py), those whose K or N is no multiple of its 32-element block kept in bf16 (refused
    where tp splits that dimension); `gains` there only on a device with MX tensor cores (Blackwell)."""
    mx = cfg.compute == "mxfp8"
    report = Fp8Report(format=cfg.compute)
    if cfg.compute not in ("fp8", "mxfp8"):
        return report
    recipe = Fp8Recipe.named(cfg.fp8_recipe)
    emulate = not (hardware_mx(device) if mx else hardware_fp8(device))
    gains = None if mx and emulate else gains
    for name, module in model.named_modules():
        shape = _linear_shape(module)
        if shape is None:
            continue
        match = BLOCK.fullmatch(global_name(name))
        if match is None:
            continue
        block, rest = int(match.group(1)), match.group(2)
        if rest.split(".")[-1] == "router":
            continue
        if is_adapter_module(rest):  # LoRA's A / B: the trained weights, in the compute precision
            report.adapters.append(name)
            continue
        if cfg.fp8_skip_first_last and block in (0, layers - 1):
            report.kept[name] = "in the first or last block (precision.fp8_skip_first_last)"
            continue
        k, n = shape
        if mx and misfit(k, n):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.comm.mesh.size(AXIS) > 1:
                raise ConfigError("parallel.tp", f"mxfp8: {global_name(name)}'s per-rank GEMM has {misfit(k, n)}; "
                                                 "choose a tp that leaves whole blocks (or precision.compute=fp8)")
            report.kept[name] = misfit(k, n)
            continue
        rows = tokens
        if isinstance(module, Experts):  # an expert sees its share of the routed rows
            rows = max(1, tokens * experts_top_k // max(1, module.w_up.shape[0] * experts_split))
        if cfg.fp8_linears == "auto" and (gains is None or not gains(rows, k, n)):
            report.kept[name] = (f"without a gain on this device (precision.fp8_linears=auto: no {cfg.compute} "
                                 "tensor cores)" if gains is None else "too small to gain (precision.fp8_linears=auto)")
            continue
        sharded: Sharded = ("out" if isinstance(module, ColumnParallelLinear)
                            else "in" if isinstance(module, RowParallelLinear) else None)
        kernel = MxKernel(emulate) if mx else Fp8Kernel(recipe, emulate, comm, sharded)
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.kernel = kernel
        elif isinstance(module, Experts):
            module.linear = kernel
        else:
            Fp8Linear.convert(module, kernel)
        report.converted.append(name)
    return report


def cast_weight_kernels(model: nn.Module) -> dict[int, Fp8Kernel]:
    """id(weight) -> its fp8 kernel, for the converted linears whose weight a ZeRO-3 fp8 gather can deliver
    already cast (parallel/zero3.py `MatmulCast`): tensorwise recipes, weights stored (out, in) - not the
    experts' stacked weights (one amax per expert) nor GPT-2's transposed Conv1D weights, which the kernel
    casts after the gather as before."""
    out: dict[int, Fp8Kernel] = {}
    for module in model.modules():
        kernel = module.kernel if isinstance(module, (Fp8Linear, ColumnParallelLinear, RowParallelLinear)) else None
        if not isinstance(kernel, Fp8Kernel) or not kernel.takes_cast_weights:
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.transposed:
            continue
        out[id(module.weight)] = kernel
    return out
