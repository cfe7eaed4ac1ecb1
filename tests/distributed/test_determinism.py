"""Deterministic mode: two runs of the same layout are bitwise identical, and the mode is in force.

On CPU with gloo two runs agree bit for bit even without the mode, so equal results alone
would pass with the mode doing nothing. The test therefore also checks, while the steps run,
what the mode sets up - deterministic kernels (an observable effect: uninitialised memory is
filled with NaN), cuDNN pinned, the NCCL / cuBLAS environment - against a run without it.
"""

import math
import os

import torch

from tests.helpers import make_config
from threefold.observe.determinism import DETERMINISTIC_ENV

RUN = ["model.preset=tiny", "train.steps=5", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
       "train.microbatches=2", "parallel.bucket_mb=0.05"]


def _mode_in_force() -> dict:
    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            "env": {key: os.environ.get(key) for key in DETERMINISTIC_ENV},
            "empty_is_nan": bool(torch.empty(64).isnan().all())}


def run(out: str, deterministic: bool) -> dict:
    from threefold.train.trainer import Trainer

    saved_env = {key: os.environ.pop(key, None) for key in DETERMINISTIC_ENV}  # a fresh process has none
    try:
        before = torch.are_deterministic_algorithms_enabled()
        trainer = Trainer(make_config(RUN + [f"train.deterministic={str(deterministic).lower()}"], out))
        seen = []
        one_step = trainer.launch_step

        def probed_step():
            seen.append(_mode_in_force())
            return one_step()

        trainer.launch_step = probed_step
        records = trainer.run()
        return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()},
                "seen": seen, "restored": torch.are_deterministic_algorithms_enabled() == before}
    finally:
        for key, value in saved_env.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def test_two_deterministic_runs_on_four_processes_are_bitwise_identical(worlds, tmp_path):
    control = worlds(4).run(run, str(tmp_path / "c"), False)
    first = worlds(4).run(run, str(tmp_path / "a"), True)
    second = worlds(4).run(run, str(tmp_path / "b"), True)
    for c in control:  # without the mode none of it is in force
        for seen in c["seen"]:
            assert not seen["algorithms"] and not seen["empty_is_nan"], seen
            assert all(v is None for v in seen["env"].values()), seen
    for a, b in zip(first, second):
        assert len(a["seen"]) == 5
        for seen in a["seen"]:  # at every step, on every rank
            assert seen["algorithms"] and seen["empty_is_nan"], seen
            assert seen["cudnn"] == (True, False), seen
            assert seen["env"] == DETERMINISTIC_ENV, seen
        assert a["restored"]  # switched back off for the next job in this process
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]  # exact float equality
        for name, p in a["params"].items():
            assert torch.equal(p.view(torch.int32), b["params"][name].view(torch.int32)), name
    assert all(math.isfinite(x) for x in first[0]["losses"])
    assert first[0]["losses"][0] != first[0]["losses"][-1]  # it trained
    assert first[0]["losses"] == control[0]["losses"]  # the mode changes no arithmetic here
