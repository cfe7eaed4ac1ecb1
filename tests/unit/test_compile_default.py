"""`train.compile` settled for the device a run uses (`Sections.compile_for`): `auto` compiles per block with
CUDA where compiled training is known to work and stays eager on the CPU; a choice is kept."""

from dataclasses import replace

import pytest

from threefold.config import load_config


def _auto(*overrides: str):
    cfg = load_config(None, list(overrides))
    return replace(cfg, train=replace(cfg.train, compile="auto"))


def test_auto_compiles_on_cuda_and_stays_eager_on_the_cpu():
    cfg = _auto()
    assert cfg.compile_for("cuda") is True
    assert cfg.compile_for("cpu") is False
    assert cfg.compile_unknown() == []


@pytest.mark.parametrize("overrides", [["parallel.dp=2", "parallel.zero=3"], ["parallel.pp=2", "train.microbatches=2"],
                                       ["parallel.tp=2", "parallel.sequence_parallel=true",
                                        "remat.policy=selective"], ["precision.compute=fp8"]])
def test_auto_compiles_the_layouts_compared_with_eager(overrides):
    assert _auto(*overrides).compile_for("cuda") is True


@pytest.mark.parametrize("override, key", [("remat.offload=cpu", "remat.offload"),
                                           ("model.preset=tiny-moe", "model.experts"),
                                           ("compress.method=powersgd", "compress.method"),
                                           ("train.sync_every=4", "train.sync_every")])
def test_auto_stays_eager_where_compiled_training_is_not_known_to_work(override, key):
    cfg = _auto(override)
    assert cfg.compile_unknown() == [key]
    assert cfg.compile_for("cuda") is False


@pytest.mark.parametrize("choice", [True, False])
def test_a_choice_is_kept_on_every_device(choice):
    cfg = load_config(None, [f"train.compile={str(choice).lower()}"])
    assert cfg.compile_for("cuda") is choice and cfg.compile_for("cpu") is choice
