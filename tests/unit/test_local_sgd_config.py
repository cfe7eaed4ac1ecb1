"""Bad input for local SGD / DiLoCo / EASGD: one ConfigError naming the key and the fix (exit 2 on the CLI)."""

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError


@pytest.mark.parametrize("overrides, world, field, words", [
    (["train.sync_every=0"], 2, "train.sync_every", "at least 1"),
    (["train.sync_every=4", "parallel.zero=3"], 2, "train.sync_every", "ZeRO-3 shards weights"),
    (["train.sync_every=4", "parallel.zero=1"], 2, "train.sync_every", "parallel.zero=0"),
    (["train.outer_optimizer=nesterov", "compress.method=powersgd"], 2, "compress.method", "compress.method=none"),
    (["train.sync_warmup_steps=-1"], 2, "train.sync_warmup_steps", "at least 0"),
    (["train.outer_optimizer=nesterov", "train.outer_momentum=1.0"], 2, "train.outer_momentum", "in [0, 1)"),
    (["train.easgd_alpha=0.5"], 2, "train.easgd_alpha", "[0, 0.5)"),
    (["train.easgd_alpha=0.1", "train.outer_optimizer=nesterov"], 2, "train.easgd_alpha", "outer_optimizer=none"),
    (["train.sync_every=2", "parallel.ep=2", "model.experts=2"], 2, "train.sync_every", "--ep 1"),
    (["train.outer_optimizer=adam"], 2, "train.outer_optimizer", "not one of none, nesterov"),
])
def test_periodic_mistakes_name_the_key_and_the_fix(overrides, world, field, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).validate(world)
    assert info.value.field == field
    assert words in str(info.value)


def test_periodic_is_off_by_default_and_on_for_each_algorithm():
    assert not load_config(None, []).validate(2).train.periodic
    for keys in (["train.sync_every=2"], ["train.outer_optimizer=nesterov"], ["train.easgd_alpha=0.1"]):
        assert load_config(None, keys).validate(2).train.periodic
