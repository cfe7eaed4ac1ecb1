"""The tensor-plan vocabulary: how a model says which modules split over tp, and how.

A plan is data. Models write plans (models/), strategies apply them (parallel/tensor_plan.py);
this module sits below both, so neither imports the other. A plan names modules by pattern
(`*` matches one name component, e.g. `blocks.*.attn.q`):

    layers       module -> style: ColumnParallel (optionally fused q/k/v), GroupedKV, RowParallel,
                 VocabEmbedding, VocabHead, VocabLoss. The module is replaced by its parallel
                 version holding this rank's slice of the single-device weights; parameter
                 names do not change.
    regions      modules whose input enters the tp region once (f, or the SP all-gather),
                 e.g. attention and MLP, so q, k, v share one collective.
    sequence     modules that run on sequence-split activations under SP (norms): their
                 parameters' gradients are summed over tp.
    partial      modules whose (replicated) parameters each rank applies to only its heads
                 (per-head q/k norms): their gradients are summed over tp.
    scatter_sequence  module -> dim: outputs that are cut along the sequence under SP (a
                 learned position table, added to the sequence-split embedding).
    scatter_inputs    module -> dim: first inputs cut along the sequence under SP (where a
                 library model's sequence-parallel region begins).
    attributes   module -> {attribute: value} to set after sharding (a library model's
                 cached head counts); `sequence_attributes` the same, only under SP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError


class TensorPlanError(UserError):
    """A model cannot be split as asked: names the module, the size and the constraint."""


@dataclass(frozen=True)
class ColumnParallel:
    """Output features split over tp in whole units (a head's width), e.g. q, MLP up/gate.

    `fused` > 1: the tensor is that many projections side by side (GPT-2's q/k/v in c_attn); each
    is split alike, so a rank keeps the same heads of every one (a strided Placement).
    `transposed`: the weight is (in, out), as in GPT-2's Conv1D, rather than a Linear's (out, in).
    """

    unit: int = 1
    what: str = "output features"  # named in errors, e.g. "attention heads (model.heads)"
    fused: int = 1
    transposed: bool = False


@dataclass(frozen=True)
class GroupedKV:
    """Key/value projection of grouped-query attention.

    kv_heads divisible by tp: split by whole kv heads (each rank's q heads use exactly its kv
    heads). tp divisible by kv_heads: the weight is replicated, each rank uses the one kv head
    its q heads belong to, and the gradient is summed over tp. Anything else: an error.
    """

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RowParallel:
    """Input features split over tp (attention output, MLP down); output summed over tp.
    `transposed`: the weight is (in, out) (GPT-2's Conv1D)."""

    unit: int = 1
    what: str = "input features"
    transposed: bool = False


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding rows split over the vocabulary, padded to a multiple of tp with zero rows.

    Under SP its reduction is a reduce-scatter along the sequence (the SP region starts here),
    unless `sequence_output` is False (a library model that reads the sequence length off the
    embedding's output; its plan cuts the sequence later with `scatter_inputs`).
    """

    vocab: int
    sequence_output: bool = True


@dataclass(frozen=True)
class VocabHead:
    """Output projection split over the (padded) vocabulary; `gather_output` for library losses."""

    vocab: int
    gather_output: bool = False


@dataclass(frozen=True)
class VocabLoss:
    """Token cross-entropy (sum) on vocabulary-split logits: never gathers them. `real`: the ids that
    are tokens when `vocab` counts padded rows (`model.vocab_multiple`); 0 = all of them."""

    vocab: int
    real: int = 0


@dataclass(frozen=True)
class TensorPlan:
    layers: dict[str, object]
    regions: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    scatter_sequence: dict[str, int] = field(default_factory=dict)
    scatter_inputs: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, dict] = field(default_factory=dict)
    sequence_attributes: dict[str, dict] = field(default_factory=dict)
    partial: tuple[str, ...] = ()
    seq_dim: int = 1  # the sequence dimension of the activations between regions (b, s, h)
    supports_sequence_parallel: bool = True
