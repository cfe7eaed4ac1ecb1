"""Data parallelism: gradients summed over the dp axis in buckets, overlapped with backward.

Written on `comm/` rather than by wrapping DistributedDataParallel, so every byte is counted
and the same buckets serve compression hooks and ZeRO. The reducer *sums*: the training step
divides each micro-batch's summed token loss by the global token count before backward, so
the sum over ranks is already the gradient of the global mean loss (exact even when ranks
hold different numbers of tokens).

Gradient accumulation: during every micro-batch but the last, buckets only accumulate
locally; the last micro-batch's backward launches each bucket's all-reduce the moment the
bucket is full, while autograd goes on computing earlier layers' gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..comm.compression.dense import DenseHook
from ..comm.compression.hook import CommHook
from .buckets import Bucket, GradientBuckets


class DataParallelReducer:
    """Sums the gradients of `params` over `axis` of the mesh."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, bucket_mb: float = 25.0,
                 hook: CommHook | None = None, axis: str = ""):
        self.comm = comm
        self.axis = axis or comm.mesh.replica_axis  # by default the mesh's replica axes (dp, cp) together
        self.hook = hook or DenseHook()
        self._update_pre_hooks: list = []
        self.buckets = GradientBuckets(
            params, int(bucket_mb * 2**20),
            launch=self._launch,
            complete=self.hook.complete)

    def _launch(self, bucket: Bucket):
        for hook in self._update_pre_hooks:  # e.g. an async checkpoint still copying the hook's state
            hook()
        return self.hook.launch(bucket, self.comm, self.axis)

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before the comm hook's state (`state_dict`) changes: before each launch."""
        self._update_pre_hooks.append(hook)

    def micro_batch(self, last: bool):
        """Run one micro-batch's backward inside; only the last one communicates."""
        return self.buckets.accumulating(last)

    def finish(self) -> None:
        """After the last backward: launch what is left, wait for every bucket."""
        self.buckets.flush()

    def zero_grad(self) -> None:
        self.buckets.zero_grad()

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor:
        """Where `param`'s gradient accumulates before `finish()` (a view of its bucket)."""
        return param.grad

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The hook's memory (compression residuals, momenta, warm-up position) as named tensors.

        "bucket.<index>.<name>" for what the hook keeps per bucket, "hook.<name>" for the rest.
        Every rank has its own (residuals differ between dp ranks); an empty dict for plain sums.
        """
        out = {f"bucket.{b.index}.{name}": t for b in self.buckets.buckets for name, t in b.state.items()
               if not name.startswith("_") and isinstance(t, torch.Tensor)}
        out.update({f"hook.{name}": t for name, t in self.hook.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned (same dp rank, layout and bucket sizes)."""
        hook_state = {}
        for key, tensor in state.items():
            kind, _, rest = key.partition(".")
            if kind == "hook":
                hook_state[rest] = tensor
                continue
            index, _, name = rest.partition(".")
            if kind != "bucket" or not index.isdigit() or int(index) >= len(self.buckets.buckets):
                raise ValueError(f"compression state '{key}' does not belong to this model's "
                                 f"{len(self.buckets.buckets)} gradient buckets")
            bucket = self.buckets.buckets[int(index)]
            held = bucket.state.get(name)
            if held is not None and held.shape != tensor.shape:
                raise ValueError(f"compression state '{key}' has shape {tuple(tensor.shape)}, this bucket needs "
                                 f"{tuple(held.shape)} (saved with another layout or bucket size)")
            bucket.state[name] = tensor.clone().to(bucket.buffer.device)
        if hook_state:
            self.hook.load_state_dict(hook_state)

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets.buckets]

    def weight_tensors(self) -> list[torch.Tensor]:
        return []  # the module's parameters are the only weights

    def gather_for(self, params: list[nn.Parameter]) -> None:
        """Nothing to gather: every rank holds its parameters whole."""

    @property
    def replicated(self) -> bool:
        """Whether every dp rank ends `finish()` with bitwise the same gradients (the dense sum)."""
        return self.hook.replicated

    @property
    def applies_momentum(self) -> bool:
        """Whether the hook applies the optimizer's momentum before the exchange (DGC's correction)."""
        return self.hook.applies_momentum

    def optimizer_for(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the hook needs in place of `optimizer` (1-bit Adam for its hook)."""
        return self.hook.optimizer_for(optimizer, self.comm, self.axis)

    def gradient_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets.buckets)


def parallelize_data(model: nn.Module, comm: Comm, bucket_mb: float = 25.0,
                     hook: CommHook | None = None) -> DataParallelReducer:
    """Attach a bucketed gradient reducer over the replica axes to `model`'s trainable parameters."""
    return DataParallelReducer(list(model.parameters()), comm, bucket_mb, hook)
