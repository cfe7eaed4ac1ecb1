"""One registry per extension point (model families, schedules) and the cp axis in the config."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "threefold"


# ------------------------------------------------------------------ parallel.cp


def test_cp_above_1_validates_and_refuses_what_is_not_wired_in_one_line():
    assert load_config(None, ["model.preset=tiny", "parallel.cp=2"]).validate(2).parallel.dp == 1
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=tiny", "parallel.cp=2", "remat.offload=cpu"]).validate(2)
    assert str(e.value) == ("remat.offload: remat.offload=cpu with parallel.cp=2 is not wired yet; use parallel.cp=1 "
                            "or drop it")
    assert "\n" not in e.value.line()


def test_cp_from_the_command_line_and_in_the_world_size():
    from threefold.train.command import OPTION_KEYS, add_arguments, overrides_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    overrides = overrides_from(parser.parse_args(["--cp", "2", "--tp", "2"]))
    assert "parallel.cp=2" in overrides and OPTION_KEYS["cp"] == "parallel.cp"
    cfg = load_config(None, ["model.preset=tiny", *overrides])
    assert cfg.parallel.cp == 2 and load_config(None, ["model.preset=tiny"]).parallel.cp == 1
    with pytest.raises(ConfigError, match=r"layout dp=auto x cp=2 x tp=2 x pp=1 does not match the world size 6"):
        cfg.validate(6)  # dp x cp x tp x pp: 6 is no multiple of 4
    assert cfg.validate(8).parallel.dp == 2  # dp = 8 / (2 x 2)
    with pytest.raises(ConfigError, match="parallel.cp: must be at least 1"):
        load_config(None, ["model.preset=tiny", "parallel.cp=0"]).validate(1)
    assert load_config(None, ["model.preset=tiny", "parallel.tp=2"]).validate(4).parallel.dp == 2  # cp=1: as before


def test_elastic_layout_keeps_cp_and_shrinks_dp():
    from threefold.config.elastic import rederive

    cfg = load_config(None, ["model.preset=tiny", "parallel.dp=4", "parallel.cp=2", "train.global_batch=8",
                             "parallel.elastic_world=8"])
    half = rederive(cfg, 4, lambda c, world: c)  # the layout only 
    assert (half.parallel.dp, half.parallel.cp, half.train.microbatches) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"cp=2 x tp=1 x pp=1 = 2 does not divide 3"):
        rederive(cfg, 3, lambda c, world: c)


def test_layout_world_size_and_axis_roles():
    from threefold.mesh import AXES, BATCH, REPLICA, SEQUENCE, Layout, axes_where

    assert AXES == ("pp", "dp", "cp", "tp")  # cp next to tp: its ranks are close
    assert Layout(dp=2, cp=2, tp=2).world_size == 8 and str(Layout(dp=2, cp=2)) == "dp=2 tp=1 pp=1 cp=2"
    assert str(Layout(dp=2)) == "dp=2 tp=1 pp=1"  # cp = 1 is not named
    assert axes_where(REPLICA) == ("dp", "cp") and axes_where(BATCH) == ("dp",) and axes_where(SEQUENCE) == ("cp",)


# ------------------------------------------------------------------ model families


def test_config_reads_the_family_registry():
    from threefold.config import hf
    from threefold.config.families import FAMILIES

    assert hf.SUPPORTED == tuple(FAMILIES)
    assert hf.ARCHITECTURES == {f.model_type: arch for arch, f in FAMILIES.items()}
    assert hf.MOE == ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    assert "config/hf.py" not in {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                                  if '"LlamaForCausalLM"' in p.read_text() and p.name != "families.py"}


def test_every_family_names_a_spec_function():
    from threefold.config.families import FAMILIES
    from threefold.models.registry import PREFIXES, SPEC_MODULES

    assert {f.module for f in FAMILIES.values()} == set(SPEC_MODULES)
    for family in FAMILIES.values():
        assert SPEC_MODULES[family.module]().__module__ == f"threefold.models.{family.module}", family
    assert list(PREFIXES) == ["hf:", "py:"]


# ------------------------------------------------------------------ schedules


SCHEDULE_NAME = re.compile(r"""["'](gpipe|1f1b|zb-h1|zb-v|dualpipev|pipedream-2bw)["']""")


def test_schedule_names_live_only_in_the_registry():
    """config/ and planner/ read every schedule's name and properties from schedules/registry.py."""
    spelled = [f"{p.relative_to(SRC)}:{i}" for folder in ("config", "planner") for p in (SRC / folder).rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if SCHEDULE_NAME.search(line.split("#")[0]) or re.search(r'== "interleaved"', line)]
    assert spelled == []


def test_the_registry_says_what_config_and_planner_ask():
    from threefold.config.sections import PipelineConfig
    from threefold.schedules.registry import DEFAULT_SCHEDULE, SCHEDULES, VIRTUAL_SCHEDULE
    from threefold.planner.search import SEARCHED

    assert VIRTUAL_SCHEDULE == "interleaved" and SCHEDULES["interleaved"].needs_virtual_stages
    assert [n for n, k in SCHEDULES.items() if k.needs_virtual_stages] == ["interleaved"]
    assert {f.name: f.default for f in dataclasses.fields(PipelineConfig)}["schedule"] == DEFAULT_SCHEDULE
    assert SEARCHED == ("1f1b", "interleaved", "zb-h1", "gpipe", "zb-v", "dualpipev")
    with pytest.raises(ConfigError, match=r"^train.microbatches: interleaved needs at least as many micro-batches"):
        load_config(None, ["model.preset=tiny", "parallel.pp=2", "pipeline.schedule=interleaved",
                           "pipeline.virtual_stages=2", "model.layers=4"]).validate(2)
