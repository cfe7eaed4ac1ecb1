"""Stage split: explicit boundaries, balance by parameters or time, global names, config errors."""

import pytest
import torch

from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.models.decoder import Decoder, build_model, init_parameters
from threefold.pipeline import plan_stages
from threefold.pipeline.adapter import DecoderAdapter
from threefold.config.checks import parse_split
from threefold.pipeline.stage import (RankModule, balance, global_names, materialise, measured_costs,
                                      stages_from_bounds)


def _cfg(*overrides, world=1):
    return load_config(None, ["model.preset=tiny", *overrides]).validate(world)


def test_parse_split():
    assert parse_split("2, 5,7", 8, 4) == [0, 2, 5, 7]
    with pytest.raises(ConfigError, match="pipeline.split: 2 boundaries for 4 stages"):
        parse_split("2,5", 8, 4)
    with pytest.raises(ConfigError, match="must increase strictly within 1..7"):
        parse_split("2,2,7", 8, 4)
    with pytest.raises(ConfigError, match="must increase strictly within 1..7"):
        parse_split("2,5,8", 8, 4)
    with pytest.raises(ConfigError, match="not a comma-separated list"):
        parse_split("two", 8, 2)


def test_balance_minimises_the_largest_stage():
    assert balance([1.0] * 8, 4) == [0, 2, 4, 6]
    assert balance([1.0] * 8, 2, first_extra=2.0) == [0, 3]  # the embedding weighs on stage 0
    assert balance([1.0] * 8, 2, last_extra=2.0) == [0, 5]
    assert balance([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert balance([1.0] * 3, 3) == [0, 1, 2]
    with pytest.raises(ConfigError, match="5 pipeline stages but only 4 layers"):
        balance([1.0] * 4, 5)


def test_plan_stages_explicit_and_by_parameters():
    cfg = _cfg("model.layers=8")
    model = build_model(cfg.model, 0)
    stages = plan_stages(model, DecoderAdapter(), cfg, 4)
    assert [s.layers for s in stages] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [(s.first, s.last) for s in stages] == [(True, False), (False, False), (False, False), (False, True)]
    cfg = _cfg("model.layers=8", "parallel.pp=4", "pipeline.split=1,3,6", world=4)
    assert [s.layers for s in plan_stages(model, DecoderAdapter(), cfg, 4)] == [range(0, 1), range(1, 3), range(3, 6),
                                                                                 range(6, 8)]


def test_balance_by_measured_time():
    cfg = _cfg("model.layers=4", "train.global_batch=2", "train.seq_len=8")
    model = build_model(cfg.model, 0)
    layer_costs, first, last = measured_costs(model, DecoderAdapter(), cfg.model, (2, 8), torch.device("cpu"),
                                              repeats=1)
    assert len(layer_costs) == 4 and all(c > 0 for c in layer_costs) and first > 0 and last > 0
    cfg = _cfg("model.layers=4", "train.global_batch=2", "train.seq_len=8", "pipeline.balance=time", "parallel.pp=2",
               world=2)
    stages = plan_stages(model, DecoderAdapter(), cfg, 2)
    assert stages[0].layers.start == 0 and stages[-1].layers.stop == 4 and len(stages) == 2


def test_rank_module_keeps_global_names_and_single_device_values():
    cfg = _cfg("model.layers=4")
    full = build_model(cfg.model, seed=3)
    adapter = DecoderAdapter()
    stages = stages_from_bounds([0, 2], 4)
    last = RankModule(full, adapter, [stages[1]])
    names = global_names(last, adapter.tied(full))
    assert names["head.weight"] == "embed.tok.weight"
    assert names["blocks.3.mlp.up.weight"] == "blocks.3.mlp.up.weight"
    assert not any(n.startswith(("blocks.0.", "blocks.1.", "embed.")) for n in names)
    # the same stage built on the meta device and materialised alone has the same values
    with torch.device("meta"):
        meta_model = Decoder(cfg.model)
    meta_model.tie_weights()
    alone = RankModule(meta_model, adapter, [stages[1]])
    materialise(alone, torch.device("cpu"), adapter.tied(meta_model),
                lambda named: init_parameters(named, 3, cfg.model))
    reference = dict(full.named_parameters())
    for local, p in alone.named_parameters():
        assert torch.equal(p, reference[names[local]]), local
    first = RankModule(meta_model, adapter, [stages[0]])
    assert "embed.tok.weight" in dict(first.named_parameters())


@pytest.mark.parametrize("overrides, world, field, text", [
    (["parallel.pp=4", "model.layers=2"], 4, "parallel.pp", "4 pipeline stages"),
    (["parallel.pp=2", "pipeline.virtual_stages=2", "model.layers=3", "pipeline.schedule=interleaved",
      "train.microbatches=2"], 2, "parallel.pp", "use at most 3 stages"),
    (["parallel.pp=4", "model.layers=8", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2",
      "train.microbatches=2"], 4, "train.microbatches",
     r"interleaved needs at least as many micro-batches as pipeline ranks \(2 < 4\)"),  # the registry's check
    (["parallel.pp=2", "model.layers=4", "pipeline.virtual_stages=2"], 2, "pipeline.virtual_stages", "interleaved"),
    (["parallel.pp=2", "model.layers=4", "pipeline.split=1,2"], 2, "pipeline.split", "2 boundaries for 2 stages"),
    # the V schedules: two chunks per rank (pp x 2 stages), dualpipev m >= 2 pp
    (["parallel.pp=4", "model.layers=6", "pipeline.schedule=zb-v", "train.microbatches=8"], 4, "parallel.pp",
     r"8 pipeline stages \(pp x 2 chunks per rank\)"),
    (["parallel.pp=4", "model.layers=8", "pipeline.schedule=dualpipev", "train.microbatches=6", "train.global_batch=12"], 4,
     "train.microbatches", r"dualpipev needs at least as many micro-batches as stages, 2 x pp \(6 < 8\); raise"),
    (["parallel.pp=2", "model.layers=8", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2"], 2,
     "pipeline.virtual_stages", "places 2 chunks per rank itself"),
])
def test_bad_pipeline_configs(overrides, world, field, text):
    with pytest.raises(ConfigError, match=text) as e:
        _cfg(*overrides, world=world)
    assert e.value.field == field


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="pipeline.schedule: 'pipedream' is not one of gpipe, 1f1b, interleaved, zb-h1"):
        load_config(None, ["pipeline.schedule=pipedream"])
