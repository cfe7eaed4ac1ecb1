"""What reaches the attention kernels, counted at the dispatcher (no threefold code on this side):
host reads (`aten._local_scalar_dense`, `aten.item`, `aten.is_nonzero`: a device->host copy and a
wait on a GPU), and every SDPA-family aten op with the mask or bias it is handed."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")
FUSED = ("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward",
         "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
         "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_efficient_attention_backward",
         "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward")
MASK_ARGS = ("attn_mask", "attn_bias")


class AttentionWatch(TorchDispatchMode):
    """`reads`: the host reads seen; `kernels`: the SDPA-family ops run; `masks`: (op, dtype) of every
    mask or bias one of them was handed."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.kernels: list[str] = []
        self.masks: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in HOST_READS:
            self.reads.append(name)
        if "scaled_dot_product" in name:
            self.kernels.append(name)
            for i, arg in enumerate(func._schema.arguments):
                if arg.name in MASK_ARGS:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    if isinstance(value, torch.Tensor):
                        self.masks.append((name, value.dtype))
        return func(*args, **kwargs)

    def unfused(self) -> list[str]:
        """The SDPA-family ops that are not a fused kernel (the math path)."""
        return [k for k in self.kernels if k not in FUSED]
