"""Configuration mistakes around ZeRO, offload and precision give one clear error naming the key."""

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError


@pytest.mark.parametrize("overrides, key, text", [
    (["parallel.zero=4"], "parallel.zero", "must be in [0, 3] (the ZeRO stage), got 4"),
    (["parallel.zero=-1"], "parallel.zero", "must be in [0, 3]"),
    (["parallel.offload=optimizer"], "parallel.offload", "needs ZeRO stage 1, 2 or 3"),
    (["parallel.offload=params"], "parallel.offload", "is not one of none, optimizer"),
    (["precision.compute=fp4"], "precision.compute", "is not one of auto, fp32, bf16, fp16, fp8"),
    (["precision.backoff_factor=1.5"], "precision.backoff_factor", "must be in (0, 1), got 1.5"),
    (["remat.policy=some"], "remat.policy", "is not one of"),
    (["parallel.bucket_mb=0"], "parallel.bucket_mb", "must be positive"),
])
def test_bad_inputs_name_the_key_and_the_fix(overrides, key, text):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).validate(2)
    assert info.value.field == key and text in str(info.value)


def test_supported_combinations_validate():
    for stage in (1, 2, 3):
        cfg = load_config(None, [f"parallel.zero={stage}", "parallel.offload=optimizer", "precision.compute=bf16",
                                 "remat.policy=selective"]).validate(2)
        assert cfg.parallel.zero == stage
