"""The keys that do nothing under some settings (NIL_EFFECTS) and those that always act (ALWAYS_EFFECTIVE):
a key set away from its default where it changes nothing is refused (or warned), and a unit test holds
every field of the sections against the two tables (tests/unit/test_nil_effects.py). checks.py refuses
what `nil_effects` finds; the trainer's start-up warns what `nil_effect_warnings` finds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .sections import Sections

_WARMED_UP = ("onebit", "powersgd")  # the compressors that start after compress.warmup_steps dense steps


# Every key whose effect depends on another setting (an axis of the layout, a policy, a method) is
# listed with the condition under which it does something. A key set away from its default while
# its condition is false is refused (or, where a smaller world can legitimately reach the
# condition - dp shrinking to 1 on an elastic restart, a job tried on one process - warned). A
# unit test holds every field of the sections against this table, so a new key must be placed.


@dataclass(frozen=True)
class NilEffect:
    keys: tuple[str, ...]  # "section.field"
    applies: Callable[[Sections, int], bool]  # (config, dp) -> whether the keys do anything
    needs: str  # the condition, as the user would set it
    refuse: bool = True

    def message(self, key: str, c: Sections) -> str:
        value = _values(c)[key]
        return (f"{value!r} has no effect unless {self.needs}; set that, or drop {key}"
                + ("" if self.refuse else " (it is ignored in this run)"))


def _sgd(c: Sections, dp: int) -> bool:
    return c.train.optimizer == "sgd"


NIL_EFFECTS: tuple[NilEffect, ...] = (
    # a layout file for tp > 1 tried with tp=1 keeps its sequence-parallel flag: warned, not refused
    NilEffect(("parallel.sequence_parallel",), lambda c, dp: c.parallel.tp > 1, "parallel.tp > 1", refuse=False),
    NilEffect(("pipeline.schedule", "pipeline.virtual_stages", "pipeline.split", "pipeline.balance"),
              lambda c, dp: c.parallel.pp > 1, "parallel.pp > 1"),
    NilEffect(("parallel.offload_dir", "parallel.offload_prefetch", "parallel.offload_block_mb",
               "parallel.offload_return_memory"),
              lambda c, dp: c.parallel.offload == "nvme", "parallel.offload=nvme"),
    NilEffect(("parallel.cp_method",), lambda c, dp: c.parallel.cp > 1, "parallel.cp > 1"),
    NilEffect(("remat.every",), lambda c, dp: c.remat.policy == "every-k", "remat.policy=every-k"),
    NilEffect(("remat.targets",), lambda c, dp: c.remat.policy == "selective", "remat.policy=selective"),
    NilEffect(("remat.offload_blocks",), lambda c, dp: c.remat.offload == "cpu", "remat.offload=cpu"),
    NilEffect(("precision.initial_scale", "precision.growth_interval", "precision.growth_factor",
               "precision.backoff_factor"), lambda c, dp: c.precision.compute == "fp16",
              "precision.compute=fp16 (the loss scaler)"),
    NilEffect(("precision.fp8_recipe",), lambda c, dp: c.precision.compute == "fp8", "precision.compute=fp8"),
    NilEffect(("precision.fp8_linears", "precision.fp8_skip_first_last"),
              lambda c, dp: c.precision.compute in ("fp8", "mxfp8"), "precision.compute=fp8 or mxfp8"),
    NilEffect(("train.beta1", "train.beta2", "train.eps"), lambda c, dp: not _sgd(c, dp), "train.optimizer=adamw"),
    NilEffect(("train.momentum", "train.nesterov"), _sgd, "train.optimizer=sgd"),
    NilEffect(("train.muon_momentum", "train.muon_ns_steps", "train.muon_nesterov"),
              lambda c, dp: c.train.optimizer == "muon", "train.optimizer=muon"),
    NilEffect(("train.outer_lr", "train.outer_momentum"), lambda c, dp: c.train.outer_optimizer != "none",
              "train.outer_optimizer=nesterov (DiLoCo)"),
    NilEffect(("train.sync_warmup_steps", "train.sync_optimizer_state"), lambda c, dp: c.train.periodic,
              "train.sync_every > 1 (or an outer optimizer / EASGD)"),
    NilEffect(("train.eval_batches",), lambda c, dp: c.train.eval_every > 0, "train.eval_every > 0"),
    NilEffect(("compress.dgc_sparsity", "compress.dgc_warmup_steps", "compress.dgc_momentum",
               "compress.dgc_momentum_correction", "compress.dgc_local_clip"),
              lambda c, dp: c.compress.method == "dgc", "compress.method=dgc"),
    NilEffect(("compress.onebit_adam",), lambda c, dp: c.compress.method == "onebit", "compress.method=onebit"),
    NilEffect(("compress.powersgd_rank",), lambda c, dp: c.compress.method == "powersgd", "compress.method=powersgd"),
    NilEffect(("compress.error_feedback",), lambda c, dp: c.compress.method in ("dgc", "onebit", "powersgd"),
              "compress.method is dgc, onebit or powersgd"),
    NilEffect(("compress.warmup_steps",), lambda c, dp: c.compress.method in _WARMED_UP,
              "compress.method is onebit or powersgd"),
    NilEffect(("checkpoint.mtbf_hours", "checkpoint.restart_seconds"),
              lambda c, dp: c.checkpoint.save_every == "auto", "checkpoint.save_every=auto"),
    NilEffect(("debug.hang_timeout_s", "debug.hang_grace_s"), lambda c, dp: c.debug.watchdog, "debug.watchdog=true"),
    NilEffect(("debug.straggler_ratio",), lambda c, dp: c.debug.stats, "debug.stats=true"),
    NilEffect(("fault.step", "fault.kind", "fault.module", "fault.delay_s", "fault.layout", "fault.hold_file",
               "fault.signal"),
              lambda c, dp: c.fault.rank >= 0, "fault.rank >= 0"),
    # dp = 1: nothing crosses dp; a smaller elastic world or a trial on one process reaches it legitimately
    NilEffect(("compress.method", "compress.hierarchical", "parallel.bucket_mb", "debug.replica_check_every",
               "train.sync_every", "train.outer_optimizer", "train.easgd_alpha"),
              lambda c, dp: dp > 1, "dp > 1 (more than one data-parallel replica)", refuse=False),
)

# The fields whose effect depends on no other setting (or whose dependence is a check of its own
# above, e.g. parallel.offload needing ZeRO). Together with NIL_EFFECTS they cover every field of
# these sections; the other sections (model, data, run) describe the job itself.
ALWAYS_EFFECTIVE = frozenset({
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.zero", "parallel.ep", "parallel.zero_weight_comm",
    "parallel.zero_grad_comm", "parallel.zero_hpz", "parallel.offload", "parallel.elastic_world",
    "precision.compute", "precision.reduce_dtype", "precision.tf32", "remat.policy",
    "remat.offload",
    "train.steps", "train.global_batch", "train.microbatches", "train.seq_len", "train.optimizer", "train.lr",
    "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.seed",
    "train.deterministic", "train.eval_every", "train.compile",
    "checkpoint.save_every", "checkpoint.async_save", "checkpoint.resume", "checkpoint.keep",
    "checkpoint.init_from", "checkpoint.peer_copy",
    "debug.history", "debug.watchdog", "debug.fingerprint_every", "debug.stats", "debug.nan_check", "debug.trace",
    "debug.dump_params", "debug.comm_semantics", "debug.compile_backend", "fault.rank",
})


def nil_effects(c: Sections, dp: int) -> list[tuple[NilEffect, str]]:
    """(rule, key) for every key set away from its default where it changes nothing."""
    values, defaults = _values(c), _values(Sections())
    return [(rule, key) for rule in NIL_EFFECTS if not rule.applies(c, dp)
            for key in rule.keys if values[key] != defaults[key]]


def _values(c: Sections) -> dict[str, object]:
    """Every field of the sections by its key, "section.field"."""
    return {f"{section}.{name}": value for section, fields_ in c.to_dict().items() for name, value in fields_.items()}


def nil_effect_warnings(c: Sections) -> list[str]:
    """The warned (not refused) no-op keys of a validated config, as `key: message` lines."""
    p = c.parallel
    if not p.dp:
        return []  # not validated yet (a torchrun process before its world size is known)
    return [f"{key}: {rule.message(key, c)}" for rule, key in nil_effects(c, p.dp) if not rule.refuse]


def checked_fields() -> set[str]:
    """Every field of the sections that NIL_EFFECTS and ALWAYS_EFFECTIVE must place."""
    described = {"model", "data", "run"}  # the job itself, not a strategy's setting
    return {key for key in _values(Sections()) if key.split(".")[0] not in described}
