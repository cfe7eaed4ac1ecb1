"""What an optimizer is to threefold: one `OptimizerEntry` (optim/registry.py lists them).

An entry says how to make the torch-style optimizer over this rank's fp32 masters, which state
tensors (shaped like the parameter, fp32) it keeps per parameter, and whether it needs whole
matrices (the update of a piece depends on the rest of its matrix: Muon). Memory reports,
checkpoints (`optimizer.<kind>.<parameter>`), the planner (`state_bytes`) and docs/zero.md's
table read the entry (without importing torch: an entry's module imports it inside `make`), so a new optimizer is one file with its entry and one line in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from ..config import TrainConfig

if TYPE_CHECKING:  # the registry is read without torch (the planner, `threefold plan`)
    import torch

STATE_BYTES = 4  # every state tensor is fp32


class Matrices(Protocol):
    """What a whole-matrix optimizer is handed besides the masters (optim/exchange.py): `fn` applied
    to each whole matrix assembled from its pieces' `updates`, once, on the matrix's owner rank;
    returns each piece's part of the result (collective: every rank of the run calls it)."""

    def orthogonalise(self, updates: list[torch.Tensor],
                      fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Made:
    """What `make` gives: the optimizer, and the names of the state tensors of each master."""

    optimizer: object  # param_groups, state, defaults, step() (a torch.optim.Optimizer or one alike)
    kinds: Callable[[torch.Tensor], tuple[str, ...]]  # master -> its per-tensor state kinds


@dataclass(frozen=True)
class OptimizerEntry:
    name: str  # train.optimizer
    # (parameter groups with their masters, the train section, fused: the masters are on CUDA (one fused
    # kernel, parallel/master.py fused_on), matrices or None) -> Made;
    # a group may carry "matrix": True (whole-matrix optimizers: those masters are hidden 2-D weights)
    make: Callable[[list[dict], TrainConfig, bool, Matrices | None], Made] | None
    states: Callable[[TrainConfig, bool], tuple[str, ...]]  # (train section, hidden matrix?) -> state kinds
    whole_matrices: bool = False  # the update needs each 2-D weight whole (optim/exchange.py assembles it)
    # the update over flat fp32 views, for states streamed through memory from a scratch file
    # (parallel.offload=nvme, parallel/nvme.py): (params, grads, [views of each state kind], step count,
    # the parameter group, the train section); None: the optimizer cannot be streamed
    streamed: Callable[[list, list, list[list], int, dict, TrainConfig], None] | None = None
    summary: str = ""  # one line for docs and --help

    def state_bytes(self, cfg: TrainConfig, matrix: bool = True) -> int:
        """Bytes of optimizer state per parameter (fp32 masters not included)."""
        return STATE_BYTES * len(self.states(cfg, matrix))

    def bytes_per_param(self, cfg: TrainConfig, precision: str, matrix: bool = True) -> tuple[int, int, int]:
        """(parameter, gradient, optimizer) bytes per parameter before sharding: 16-bit compute adds an
        fp32 master to the optimizer's bytes (with fp32 compute the master is the parameter)."""
        if precision == "fp32":
            return 4, 4, self.state_bytes(cfg, matrix)
        return 2, 2, STATE_BYTES + self.state_bytes(cfg, matrix)
