"""The planner's memory prediction against the bytes real CPU runs count (metrics `mem`).

Each case trains one step of the reference model in a gloo world and compares every rank's
counted bytes (observe/memory.py: parameter, gradient and optimizer storages; bytes autograd
saves for backward) with `predict_memory(cfg, world_size)`. Add a case per strategy as it lands
(ZeRO stages, tensor parallelism, activation checkpointing, pipeline schedules): the prediction
must stay within 10% of the counted peak and of each counted part.
"""

import pytest

from tests.helpers import make_config, train_and_report
from threefold.planner.memory import predict_memory

TOLERANCE = 0.10

CASES = {
    # id: (world size, config overrides)
    "tiny-dp1": (1, ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16"]),
    "tiny-dp2-m2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "train.microbatches=2"]),
    "tiny-dp4": (4, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32"]),
    "tiny-untied-nobias-dp2": (2, ["model.preset=tiny", "train.global_batch=4", "train.seq_len=64",
                                   "model.bias=false", "model.tie_embeddings=false"]),
    "llama-gqa-dp1-m2": (1, ["model.preset=tiny-llama", "train.global_batch=4", "train.seq_len=64",
                             "train.microbatches=2"]),
    "llama-mha-dp2": (2, ["model.preset=tiny-llama", "train.global_batch=8", "train.seq_len=16", "model.kv_heads=4"]),
    "small-dp1": (1, ["model.preset=small", "train.global_batch=2", "train.seq_len=64"]),
    "small-llama-dp4-m2": (4, ["model.preset=small", "train.global_batch=8", "train.seq_len=32",
                               "train.microbatches=2", "model.mlp=swiglu", "model.norm=rmsnorm",
                               "model.position=rope"]),
    # strategies: ZeRO stages, checkpointing policies, tensor parallelism, mixed precision
    "zero1-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "parallel.zero=1"]),
    "zero2-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "parallel.zero=2"]),
    "zero3-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "parallel.zero=3"]),
    "remat-full-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "remat.policy=full"]),
    "remat-selective-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32",
                                "remat.policy=selective"]),
    "tp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "parallel.tp=2"]),
    "bf16-zero1-dp2": (2, ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "parallel.zero=1",
                           "precision.compute=bf16"]),
}


def counted_memory(overrides: list[str], out: str) -> dict:
    return train_and_report(overrides, out)["records"][-1]["mem"]


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_memory_matches_counted_bytes(worlds, tmp_path, case):
    size, overrides = CASES[case]
    overrides = [*overrides, "train.steps=1"]
    predicted = predict_memory(make_config(overrides, str(tmp_path)), size)
    for rank, counted in enumerate(worlds(size).run(counted_memory, overrides, str(tmp_path))):
        for key, value in counted.items():
            if value:
                err = abs(predicted[key] / value - 1)
                assert err <= TOLERANCE, f"rank {rank} {key}: predicted {predicted[key]} vs counted {value}"
        assert counted["peak"] > 0 and counted["activations"] > 0
