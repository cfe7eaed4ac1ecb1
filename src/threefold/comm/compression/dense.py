"""The uncompressed hook: sum the bucket over dp, optionally cast on the wire (fp16 / bf16).

Casting halves the bytes and costs one rounding per element of the sum. With `hierarchical`
the sum goes through the node axes (comm/hierarchical.py) instead of one flat ring.
"""

from __future__ import annotations

import torch

from ..collectives import Comm
from ..hierarchical import dense_all_reduce
from .hook import StatelessHook


class DenseHook(StatelessHook):
    replicated = True  # an all-reduce (flat or through the node axes) leaves one result on every rank
    def __init__(self, wire_dtype: torch.dtype | None = None, hierarchical: bool = False):
        self.wire_dtype = wire_dtype
        self.hierarchical = hierarchical

    def launch(self, bucket, comm: Comm, axis: str):
        tensor = bucket.buffer
        if self.wire_dtype is not None and self.wire_dtype != tensor.dtype:
            tensor = bucket.state["_wire"] = tensor.to(self.wire_dtype)
        return dense_all_reduce(comm, tensor, axis, self.hierarchical, async_op=True)

    def complete(self, bucket) -> None:
        wire = bucket.state.pop("_wire", None)
        if wire is not None:
            bucket.buffer.copy_(wire)
