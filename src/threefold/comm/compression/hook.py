"""What every gradient hook is: the contract between the data-parallel reducer and a compressor.

The reducer (parallel/data.py) calls `launch` when a bucket is full, `complete` after the wait,
reads `applies_momentum` and asks `optimizer_for` when the optimizer is built, and saves /
restores `state_dict` with the checkpoint. `StatelessHook` gives the defaults of a hook that keeps nothing of its own
outside `bucket.state`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..collectives import Comm


class CommHook(Protocol):
    applies_momentum: bool  # the exchange applies the optimizer's momentum (DGC's correction)
    replicated: bool  # after `complete` every rank holds bitwise the same summed gradient

    def launch(self, bucket, comm: Comm, axis: str):
        """Start communicating `bucket.buffer`; return an object with wait()."""

    def complete(self, bucket) -> None:
        """After wait(): leave the summed gradient in `bucket.buffer`."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The hook's own memory beyond `bucket.state` (checkpointed per rank)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` returned."""

    def optimizer_for(self, optimizer: torch.optim.Optimizer, comm: Comm, axis: str) -> torch.optim.Optimizer:
        """The optimizer this compression needs in place of `optimizer` (the torch AdamW / SGD over
        the fp32 masters): `optimizer` itself, or 1-bit Adam for its hook."""


class StatelessHook:
    applies_momentum = False
    replicated = False  # claimed only by hooks that prove it (the dense sum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state of its own; got {sorted(state)}")

    def optimizer_for(self, optimizer: torch.optim.Optimizer, comm: Comm, axis: str) -> torch.optim.Optimizer:
        return optimizer
