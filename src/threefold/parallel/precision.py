"""Mixed precision: the compute dtype of the model, fp32 master weights, the dynamic loss scaler.

Step 4 of `parallelize`. `auto` (the default) settles by device: bf16 compute with gradients
reduced in bf16 on CUDA, fp32 elsewhere (`PrecisionConfig.for_device`); on CUDA fp32 matmuls
use TF32 (`precision.tf32`). With `precision.compute` = bf16 or fp16 the model's floating-point
parameters are cast to that dtype, so forward and backward run in it and gradients are produced
in it. The fp32 values they had before the cast are handed on (`MixedPrecision.fp32_init`) to
the optimizer, which keeps them as *master weights*: AdamW updates fp32 masters with fp32
moments, and the result is cast back into the model after every step. The dtype gradients
travel in over dp (`precision.reduce_dtype`) is independent of both (`fp32` keeps the bits a
sum over many ranks in bf16 loses; `compute`, the CUDA default, halves the bytes and skips the
upcast and the rounding back).

With `precision.compute=fp8` the model is bf16 as above and the blocks' linears compute in float8
(parallel/fp8.py, step 2b of `parallelize`: `convert_linears`); masters and moments stay fp32.

fp16 has a narrow exponent range, so small gradients underflow to zero. The dynamic loss scaler
multiplies the loss by S before backward (gradients are S times larger), the optimizer divides
them by S again in fp32, and S adapts: after `growth_interval` steps without overflow it grows
by `growth_factor`; a step whose gradients hold inf/nan is skipped and S shrinks by
`backoff_factor`. The overflow test is the *global* gradient norm, which is summed over every
mesh axis, so every rank sees the same inf/nan and takes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import PrecisionConfig
from ..models.spec import is_state_buffer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DynamicLossScaler:
    """Loss scale for fp16: grow after `growth_interval` clean steps, back off on overflow.

    The scale, the count of clean steps and the count of skipped steps are 0-dim tensors on the
    compute device (`to(device)`), updated by torch's `_amp_update_scale_` from the device-side
    overflow flag, as CUDA loss scalers do: a step never reads them back. `scale`, `clean_steps`
    and `skipped_steps` read them (metrics, checkpoints, tests).
    """

    def __init__(self, initial_scale: float = 2.0**16, growth_interval: int = 1000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.scale_tensor = torch.tensor(float(initial_scale))
        self._clean = torch.zeros((), dtype=torch.int32)  # consecutive steps without overflow since the last change
        self._skipped = torch.zeros((), dtype=torch.int64)  # total, for metrics
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale

    def to(self, device: torch.device) -> "DynamicLossScaler":
        self.scale_tensor, self._clean, self._skipped = (t.to(device) for t in (self.scale_tensor, self._clean,
                                                                               self._skipped))
        return self

    @property
    def scale(self) -> float:
        return float(self.scale_tensor)

    @property
    def clean_steps(self) -> int:
        return int(self._clean)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    def update(self, found_inf: torch.Tensor | bool) -> None:
        """After a step: `found_inf` must be the same on every rank (it is: a global norm)."""
        flag = torch.as_tensor(found_inf, device=self.scale_tensor.device).to(torch.float32)
        torch._amp_update_scale_(self.scale_tensor, self._clean, flag, self.growth_factor, self.backoff_factor,
                                 self.growth_interval)
        self.scale_tensor.clamp_(min=self.min_scale)
        self._skipped += flag.to(self._skipped.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain JSON values for the checkpoint manifest (identical on every rank)."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale_tensor.fill_(float(state["scale"]))
        self._clean.fill_(int(state["clean_steps"]))
        self._skipped.fill_(int(state["skipped_steps"]))


@dataclass
class MixedPrecision:
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype  # dtype of gradients on the wire over dp
    scaler: DynamicLossScaler | None  # fp16 only
    # local parameter name -> its fp32 values from before the cast; consumed by the optimizer
    fp32_init: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0


def resolve_reduce_dtype(cfg: PrecisionConfig, device_type: str = "cpu") -> torch.dtype:
    cfg = cfg.for_device(device_type)
    return DTYPES[cfg.model_dtype if cfg.reduce_dtype == "compute" else cfg.reduce_dtype]


def set_tf32(device: torch.device, enabled: bool) -> None:
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (`precision.tf32`)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def apply_precision(model: nn.Module, cfg: PrecisionConfig, device_type: str = "cpu") -> MixedPrecision:
    """Cast `model`'s floating-point parameters and buffers to the compute dtype, in place
    (`auto` settled for `device_type`: bf16 on CUDA, fp32 elsewhere; fp8: bf16, its linears already
    given their fp8 matmuls by `parallel.fp8.convert_linears`)."""
    cfg = cfg.for_device(device_type)
    dtype = DTYPES[cfg.model_dtype]
    fp32_init: dict[str, torch.Tensor] = {}
    if dtype != torch.float32:
        for name, p in model.named_parameters():  # tied weights appear once
            if p.is_floating_point():
                # a frozen weight (LoRA's base) gets no master: no fp32 copy; nor does a parameter still on the
                # meta device (ZeRO-3 fills it later and keeps the fp32 values of its own chunk: materialise.py)
                if p.requires_grad and p.device.type != "meta":
                    fp32_init[name] = p.data.float()
                p.data = p.data.to(dtype)
        for buf_name, buf in list(model.named_buffers()):
            if buf.is_floating_point() and not is_state_buffer(buf_name):  # training state stays fp32
                owner, _, attr = buf_name.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = buf.to(dtype)
    scaler = None
    if cfg.compute == "fp16":
        scaler = DynamicLossScaler(cfg.initial_scale, cfg.growth_interval, cfg.growth_factor, cfg.backoff_factor)
    return MixedPrecision(dtype, resolve_reduce_dtype(cfg, device_type), scaler, fp32_init)
