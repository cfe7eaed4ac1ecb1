"""Options that change nothing under the chosen layout are refused or warned, never silently
accepted: every key of the strategy sections is either placed in the table of conditions
(config/nil_effects.py NIL_EFFECTS) or declared always effective, and each conditional key, set alone
where its condition is false, is refused or warned naming the key."""

from dataclasses import asdict

import pytest

from threefold.config import load_config
from threefold.config.nil_effects import ALWAYS_EFFECTIVE, NIL_EFFECTS, checked_fields
from threefold.config.sections import Sections
from threefold.errors import ConfigError
from threefold.train.inputs import warnings_for

# a value other than the default for each conditional key, valid in range on its own
SAMPLES = {
    "parallel.sequence_parallel": "true", "pipeline.schedule": "gpipe", "pipeline.virtual_stages": "2",
    "pipeline.split": "1", "pipeline.balance": "time", "remat.every": "3", "remat.targets": "mlp", "remat.offload_blocks": "1",
    "precision.initial_scale": "1024", "precision.growth_interval": "10", "precision.growth_factor": "4",
    "precision.backoff_factor": "0.25", "precision.fp8_recipe": "rowwise", "precision.fp8_linears": "all",
    "precision.fp8_skip_first_last": "false", "train.beta1": "0.8", "train.beta2": "0.99", "train.eps": "1e-6",
    "train.momentum": "0.5", "train.nesterov": "true", "train.outer_lr": "0.5", "train.outer_momentum": "0.5",
    "train.sync_warmup_steps": "2", "train.sync_optimizer_state": "true", "train.eval_batches": "2",
    "compress.dgc_sparsity": "0.99", "compress.dgc_warmup_steps": "2", "compress.dgc_momentum": "0.5",
    "compress.dgc_momentum_correction": "false", "compress.dgc_local_clip": "false",
    "compress.onebit_adam": "false", "compress.powersgd_rank": "2", "compress.error_feedback": "false",
    "compress.warmup_steps": "2", "checkpoint.mtbf_hours": "100", "checkpoint.restart_seconds": "10",
    "debug.hang_timeout_s": "5", "debug.hang_grace_s": "5", "debug.straggler_ratio": "2",
    "fault.step": "3", "fault.kind": "kill", "fault.module": "blocks.0.attn", "fault.delay_s": "1",
    "fault.layout": "1,1,1", "fault.hold_file": "x", "fault.signal": "SIGINT", "compress.method": "bf16", "compress.hierarchical": "true",
    "parallel.bucket_mb": "5", "debug.replica_check_every": "2", "train.sync_every": "2",
    "train.outer_optimizer": "nesterov", "train.easgd_alpha": "0.1",
    "parallel.offload_dir": "/tmp", "parallel.cp_method": "allgather", "parallel.offload_prefetch": "4", "parallel.offload_block_mb": "8",
    "parallel.offload_return_memory": "false",
    "train.muon_momentum": "0.9", "train.muon_ns_steps": "3", "train.muon_nesterov": "false",
}
# what else a key needs to be valid at all (the layout still leaves it without effect)
CONTEXT = {"train.beta1": ["train.optimizer=sgd"], "train.beta2": ["train.optimizer=sgd"],
           "train.eps": ["train.optimizer=sgd"], "pipeline.virtual_stages": ["pipeline.schedule=interleaved"], "train.nesterov": [],
           "debug.hang_timeout_s": ["debug.watchdog=false"], "debug.hang_grace_s": ["debug.watchdog=false"],
           "train.outer_optimizer": [], "train.sync_warmup_steps": [], "train.eval_batches": []}
BASE = ["model.layers=2", "train.global_batch=8"]


def conditional_keys():
    return [key for rule in NIL_EFFECTS for key in rule.keys]


def test_every_strategy_key_is_placed():
    placed = set(conditional_keys()) | ALWAYS_EFFECTIVE
    assert checked_fields() - placed == set(), "place these keys in NIL_EFFECTS or ALWAYS_EFFECTIVE"
    assert placed - checked_fields() == set(), "these placed keys are not fields"
    assert not set(conditional_keys()) & ALWAYS_EFFECTIVE


def test_every_conditional_key_has_a_sample():
    assert set(conditional_keys()) <= set(SAMPLES)


@pytest.mark.parametrize("key", conditional_keys())
def test_a_key_without_effect_is_refused_or_warned(key):
    rule = next(r for r in NIL_EFFECTS if key in r.keys)
    overrides = BASE + CONTEXT.get(key, []) + [f"{key}={SAMPLES[key]}"]
    cfg = load_config(None, overrides)
    if rule.refuse:
        with pytest.raises(ConfigError) as e:
            cfg.validate(1)
        named = [key] + [c.split("=")[0] for c in CONTEXT.get(key, [])]  # a context key may be refused first
        assert str(e.value).split(":")[0] in named, str(e.value)  # (nesterov: its own, older check says so)
    else:
        lines = [w for w in warnings_for(cfg.validate(1)) if w.startswith(f"{key}:")]
        assert len(lines) == 1 and "has no effect unless" in lines[0], warnings_for(cfg.validate(1))


@pytest.mark.parametrize("key, enable", [("parallel.sequence_parallel", ["parallel.tp=2"]),
                                         ("pipeline.schedule", ["parallel.pp=2"]),
                                         ("remat.targets", ["remat.policy=selective"]),
                                         ("train.momentum", ["train.optimizer=sgd"]),
                                         ("compress.method", ["parallel.dp=2"]),
                                         ("parallel.cp_method", ["parallel.cp=2", "train.seq_len=16"])])
def test_the_same_key_where_it_has_effect_is_accepted(key, enable):
    world = 2 if enable[0].startswith("parallel") else 1
    cfg = load_config(None, BASE + enable + [f"{key}={SAMPLES[key]}"]).validate(world)
    assert not [w for w in warnings_for(cfg) if w.startswith(f"{key}:")]


def test_defaults_are_clean():
    assert warnings_for(load_config(None, BASE).validate(1)) == []
    assert asdict(Sections())  # the table's keys are read from the dataclasses themselves
