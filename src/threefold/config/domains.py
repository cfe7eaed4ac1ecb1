"""The domain of every config key: which values mean something, checked when a config is built.

`DOMAINS` maps each key ("section.field") to one of

    Range     a finite number within bounds (`AtLeast(0)`, `Above(1)`, `POSITIVE`, `Range(0, 1, hi_open=True)`);
              `means` says what a special value (often 0 = auto / off) stands for
    Choices   one of a fixed set of strings (or a comma-separated list of them) whose type is a plain str
    Pattern   a string of a fixed shape (a regular expression)
    Text      a string that no check here can judge, named for what it is: a path ("path"), a string
              whose format `Config.validate` parses against other keys ("parsed"), or free text ("free")
    BY_TYPE   the field's type is its domain: a Literal's choices, or true / false

`check_domains` (called by load.py's `build_config` and `with_overrides`) refuses a value outside
its key's domain with a ConfigError naming the key, the value and the domain; `describe` is the
domain as `threefold train --help` shows it. The checks that relate two keys stay in checks.py.
tests/unit/test_config_domains.py walks every field: each has an entry, its default lies inside,
and a value just outside each bound is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Literal, Union

from ..errors import ConfigError
from .sections import Sections


@dataclass(frozen=True)
class Range:
    """A finite number in [lo, hi] (an open end excludes its bound)."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    means: str = ""  # what a special value stands for, e.g. "0 = never"

    def admits(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    @property
    def text(self) -> str:
        if self.hi == math.inf:
            bound = ("positive" if self.lo == 0 else f"above {self.lo}") if self.lo_open else f"at least {self.lo}"
        else:
            bound = f"in {'(' if self.lo_open else '['}{self.lo}, {_number(self.hi)}{')' if self.hi_open else ']'}"
        return bound + (f" ({self.means})" if self.means else "")

    @property
    def rule(self) -> str:
        if self.hi == math.inf and self.lo_open and self.lo != 0:
            return f"exceed {self.lo}" + (f" ({self.means})" if self.means else "")
        return f"be {self.text}"


def _number(x: float) -> str:
    """`x` as help reads it: 2^63 - 1 rather than its 19 digits."""
    if isinstance(x, int) and x > 2**32 and (x + 1).bit_count() == 1:
        return f"2^{(x + 1).bit_length() - 1} - 1"
    return str(x)


def AtLeast(lo: float, means: str = "") -> Range:  # noqa: N802 (a domain's name, as the table reads)
    return Range(lo, means=means)


def Above(lo: float, means: str = "") -> Range:  # noqa: N802
    return Range(lo, lo_open=True, means=means)


POSITIVE = Above(0)
FRACTION = Range(0, 1, hi_open=True)  # [0, 1)


@dataclass(frozen=True)
class Choices:
    """One of `values` (`listed`: a comma-separated list of them)."""

    values: tuple[str, ...]
    listed: bool = False

    def admits(self, value: str) -> bool:
        parts = [p.strip() for p in value.split(",")] if self.listed else [value]
        return all(p in self.values for p in parts)

    @property
    def text(self) -> str:
        return ("a comma-separated list of " if self.listed else "one of ") + ", ".join(self.values)

    @property
    def rule(self) -> str:
        return f"be {self.text}"


@dataclass(frozen=True)
class Pattern:
    """A string matching `regex` (whole), described by `text`."""

    regex: str
    text: str

    def admits(self, value: str) -> bool:
        return re.fullmatch(self.regex, value) is not None

    @property
    def rule(self) -> str:
        return f"be {self.text}"


@dataclass(frozen=True)
class Text:
    """A string no check here judges: a path, a format `validate` parses (against other keys), or free text."""

    kind: Literal["path", "parsed", "free"]
    text: str

    def admits(self, value: str) -> bool:
        return True


@dataclass(frozen=True)
class ByType:
    """The field's type says it all: a Literal's choices (checked with the type), or true / false."""

    text: str = ""

    def admits(self, value: object) -> bool:
        return True


BY_TYPE = ByType()
Domain = Union[Range, Choices, Pattern, Text, ByType]
_NAMES = r"\s*|\s*[A-Za-z_]\w*\s*(,\s*[A-Za-z_]\w*\s*)*"  # "" or comma-separated identifiers

DOMAINS: dict[str, Domain] = {
    # [model]
    "model.preset": Text("parsed", "a preset name, hf:DIR (a Hugging Face model directory) or py:MODULE:FACTORY"),
    "model.layers": AtLeast(1), "model.hidden": AtLeast(1), "model.heads": AtLeast(1), "model.kv_heads": AtLeast(1),
    "model.ffn_hidden": AtLeast(1), "model.vocab": AtLeast(1), "model.max_seq": AtLeast(1),
    "model.mlp": BY_TYPE, "model.norm": BY_TYPE, "model.position": BY_TYPE, "model.tie_embeddings": BY_TYPE,
    "model.bias": BY_TYPE, "model.norm_eps": POSITIVE, "model.rope_theta": POSITIVE, "model.init_std": POSITIVE,
    "model.head_size": AtLeast(0, "0 = hidden / heads"), "model.loss_chunk": AtLeast(0, "0: the whole logits at once"),
    "model.vocab_multiple": AtLeast(1, "1: no padding"), "model.experts": AtLeast(0, "0 = a dense model"),
    "model.experts_top_k": AtLeast(1), "model.shared_experts": AtLeast(0), "model.expert_ffn_hidden":
    AtLeast(0, "0 = model.ffn_hidden"), "model.moe_every": AtLeast(1), "model.moe_start": AtLeast(0),
    "model.expert_capacity": AtLeast(0, "0 = dropless"), "model.router_aux_weight": AtLeast(0),
    "model.router_z_weight": AtLeast(0), "model.lora_rank": AtLeast(0, "0: no LoRA"),
    "model.router_balance": BY_TYPE, "model.router_bias_rate": AtLeast(0, "0: a fixed bias"),
    "model.router_seq_aux_weight": AtLeast(0, "0 = no balance loss under router_balance=bias"),
    "model.lora_alpha": AtLeast(0, "0: the rank, a scaling of 1"), "model.lora_dropout": FRACTION,
    "model.lora_targets": Pattern(_NAMES, "a comma-separated list of module names, e.g. q_proj,v_proj"),
    "model.mtp_depth": AtLeast(0, "0: no multi-token prediction"), "model.mtp_weight": AtLeast(0),
    # [parallel]
    "parallel.dp": AtLeast(0, "0 = world / (cp x tp x pp)"), "parallel.tp": AtLeast(1), "parallel.pp": AtLeast(1),
    "parallel.cp": AtLeast(1), "parallel.cp_method": BY_TYPE, "parallel.zero": Range(0, 3, means="the ZeRO stage"),
    "parallel.ep": AtLeast(1), "parallel.sequence_parallel": BY_TYPE, "parallel.bucket_mb": POSITIVE,
    "parallel.zero_weight_comm": BY_TYPE, "parallel.zero_grad_comm": BY_TYPE, "parallel.zero_hpz": BY_TYPE,
    "parallel.offload": BY_TYPE, "parallel.offload_dir": Text("path", "a directory on a local SSD"),
    "parallel.offload_prefetch": AtLeast(0), "parallel.offload_block_mb": POSITIVE,
    "parallel.offload_return_memory": BY_TYPE, "parallel.elastic_world": AtLeast(0, "0 = the actual world"),
    # [pipeline]
    "pipeline.schedule": BY_TYPE, "pipeline.virtual_stages": AtLeast(1),
    "pipeline.split": Text("parsed", "the first layer of each stage after the first, comma-separated"),
    "pipeline.balance": BY_TYPE,
    # [precision]
    "precision.compute": BY_TYPE, "precision.reduce_dtype": BY_TYPE, "precision.tf32": BY_TYPE,
    "precision.initial_scale": POSITIVE, "precision.growth_interval": AtLeast(1), "precision.growth_factor": Above(1),
    "precision.backoff_factor": Range(0, 1, lo_open=True, hi_open=True), "precision.fp8_recipe": BY_TYPE,
    "precision.fp8_linears": BY_TYPE, "precision.fp8_skip_first_last": BY_TYPE,
    # [remat]
    "remat.policy": BY_TYPE, "remat.every": AtLeast(1),
    "remat.targets": Text("parsed", "comma-separated parts of each block (submodules or methods)"),
    "remat.offload": BY_TYPE, "remat.offload_blocks": Text("parsed", "block indices and ranges, e.g. 0-3,6"),
    # [compress]
    "compress.method": BY_TYPE, "compress.dgc_sparsity": FRACTION, "compress.dgc_warmup_steps": AtLeast(0),
    "compress.dgc_momentum": FRACTION, "compress.dgc_momentum_correction": BY_TYPE, "compress.dgc_local_clip": BY_TYPE,
    "compress.onebit_adam": BY_TYPE, "compress.powersgd_rank": AtLeast(1),
    "compress.warmup_steps": AtLeast(-1, "-1 = automatic"), "compress.error_feedback": BY_TYPE,
    "compress.hierarchical": BY_TYPE,
    # [train]
    "train.steps": AtLeast(0, "0: save the initial model and exit"), "train.global_batch": AtLeast(1),
    "train.microbatches": AtLeast(1), "train.seq_len": AtLeast(1), "train.optimizer": BY_TYPE, "train.lr": POSITIVE,
    "train.min_lr_ratio": Range(0, 1), "train.warmup_steps": AtLeast(0), "train.weight_decay": AtLeast(0),
    "train.beta1": FRACTION, "train.beta2": FRACTION, "train.eps": POSITIVE, "train.momentum": FRACTION,
    "train.nesterov": BY_TYPE, "train.muon_momentum": FRACTION, "train.muon_ns_steps": AtLeast(1),
    "train.muon_nesterov": BY_TYPE, "train.grad_clip": AtLeast(0, "0 disables"), "train.seed": Range(0, 2**63 - 1),
    "train.deterministic": BY_TYPE, "train.eval_every": AtLeast(0, "0: never"), "train.eval_batches": AtLeast(1),
    "train.sync_every": AtLeast(1), "train.sync_warmup_steps": AtLeast(0), "train.sync_optimizer_state": BY_TYPE,
    "train.outer_optimizer": BY_TYPE, "train.outer_lr": POSITIVE, "train.outer_momentum": FRACTION,
    "train.easgd_alpha": FRACTION,
    "train.compile": ByType("auto: per block on CUDA where known to work (Sections.compile_for), eager on the CPU"),
    # [data]
    "data.source": Text("parsed", "synthetic, stdlib, a prepared directory, a text file, a directory of text "
                                  "or a .npy token array"),
    "data.sources": Text("parsed", "prepared directories with weights, DIR:WEIGHT,DIR:WEIGHT"),
    "data.skip_bad_documents": BY_TYPE, "data.prefetch": AtLeast(0, "0: in the step"), "data.pack": BY_TYPE,
    # [checkpoint]
    "checkpoint.save_every": AtLeast(0, "0 = never"), "checkpoint.mtbf_hours": POSITIVE,
    "checkpoint.restart_seconds": AtLeast(0), "checkpoint.async_save": BY_TYPE,
    "checkpoint.resume": Text("parsed", "none, auto or a checkpoint or run directory"),
    "checkpoint.keep": AtLeast(0, "0 keeps all"), "checkpoint.init_from": Text("path", "a .safetensors file or a torch.distributed.checkpoint directory"),
    "checkpoint.peer_copy": BY_TYPE,
    # [run]
    "run.out": Text("path", "a run directory"), "run.id": Text("free", "the id of the run that owns run.out"),
    "run.device": BY_TYPE, "run.progress": BY_TYPE, "run.tensorboard": BY_TYPE,
    "run.trackers": Pattern(r"\s*|\s*(tensorboard|wandb|mlflow)\s*(,\s*(tensorboard|wandb|mlflow)\s*)*",
                            "empty or a comma-separated list of tensorboard, wandb, mlflow"),
    "run.plot": BY_TYPE, "run.collective_timeout_s": POSITIVE, "run.threads": AtLeast(0, "0 = auto"),
    # [debug]
    "debug.history": AtLeast(0, "0 turns the recorder off"), "debug.watchdog": BY_TYPE,
    "debug.hang_timeout_s": AtLeast(0, "0 = run.collective_timeout_s"), "debug.hang_grace_s": POSITIVE,
    "debug.fingerprint_every": AtLeast(0, "0 = off"), "debug.stats": BY_TYPE,
    "debug.straggler_ratio": Above(1, "slowest / median"), "debug.nan_check": BY_TYPE,
    "debug.replica_check_every": AtLeast(0, "0 = off"), "debug.trace": BY_TYPE, "debug.dump_params": BY_TYPE,
    "debug.comm_semantics": Choices(("native", "nccl")),
    "debug.compile_backend": Text("free", "a torch.compile backend name (torch._dynamo.list_backends())"),
    # [fault]
    "fault.rank": AtLeast(-1, "-1 = no fault"), "fault.step": AtLeast(0), "fault.kind": BY_TYPE,
    "fault.module": Text("free", "a module name, e.g. blocks.0.mlp"), "fault.delay_s": AtLeast(0),
    "fault.layout": Text("parsed", "dp,tp,pp or dp,tp,pp,cp; empty = any layout"), "fault.hold_file": Text("path", "a file"),
    "fault.signal": Choices(("SIGTERM", "SIGINT", "SIGUSR1"), listed=True),
}


def check_value(key: str, value: object) -> None:
    """Refuse `value` (already of the key's type) outside `key`'s domain: one line naming the key, the
    value and the domain."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    domain = DOMAINS.get(key)
    if domain is None or isinstance(domain, (Text, ByType)):
        return
    if isinstance(domain, Range) and (isinstance(value, str) or isinstance(value, bool)):
        return  # int | Literal["auto"]: the word was checked with the type
    if not domain.admits(value):
        raise ConfigError(key, f"must {domain.rule}, got {value!r}")


def check_domains(sections: Sections) -> None:
    """Every field of `sections` inside its domain."""
    for section in fields(sections):
        values = getattr(sections, section.name)
        for f in fields(values):
            check_value(f"{section.name}.{f.name}", getattr(values, f.name))


def describe(key: str) -> str:
    """The domain of `key` as help shows it ("" where the type says it, a Literal's choices or a flag)."""
    domain = DOMAINS.get(key)
    return "" if domain is None else domain.text
