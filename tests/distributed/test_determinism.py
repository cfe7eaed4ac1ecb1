"""Deterministic mode: two runs of the same layout are bitwise identical."""

import torch

from tests.helpers import make_config

RUN = ["model.preset=tiny", "train.steps=5", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
       "train.deterministic=true", "train.microbatches=2", "parallel.bucket_mb=0.05"]


def deterministic_run(out: str) -> dict:
    from threefold.train.trainer import Trainer

    before = torch.are_deterministic_algorithms_enabled()
    trainer = Trainer(make_config(RUN, out))
    during = torch.are_deterministic_algorithms_enabled()
    records = trainer.run()
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()},
            "switch": (before, during, torch.are_deterministic_algorithms_enabled())}


def test_two_deterministic_runs_on_four_processes_are_bitwise_identical(worlds, tmp_path):
    first = worlds(4).run(deterministic_run, str(tmp_path / "a"))
    second = worlds(4).run(deterministic_run, str(tmp_path / "b"))
    for a, b in zip(first, second):
        before, during, after = a["switch"]
        assert during and after == before  # on for the run, restored for the next job in this process
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]  # exact float equality
        for name, p in a["params"].items():
            assert torch.equal(p.view(torch.int32), b["params"][name].view(torch.int32)), name
    assert first[0]["losses"][0] != first[0]["losses"][-1]  # it trained
