"""ZeRO's bytes per rank, counted from storages, against the paper's formulas; offload; exact traffic.

bf16 parameters and gradients, fp32 masters and Adam moments: 16 bytes per parameter. The model
(Llama variant: untied, no frozen parameters) has sizes that split evenly over 4 ranks, so the
formulas hold with no padding at all.
"""

import torch

from tests.helpers import make_config
from tests.zero_tasks import train_stages
from threefold.models.decoder import build_model

N = 4
# gradients reduced in bf16, the parameters' dtype, so that "stage 1/2 traffic = plain DP" is exact
BASE = ["model.preset=tiny-llama", "model.layers=4", "train.steps=2", "train.global_batch=8", "train.seq_len=32",
        "precision.compute=bf16", "precision.reduce_dtype=compute"]


def test_model_state_bytes_follow_the_zero_formulas(worlds, tmp_path):
    runs = [BASE + [f"parallel.zero={z}"] for z in range(4)]
    runs += [BASE + [f"parallel.zero={z}", "parallel.offload=optimizer"] for z in (1, 2, 3)]
    reports = worlds(N).run(train_stages, runs, str(tmp_path))
    model = build_model(make_config(BASE, "unused").model, seed=0)
    P = sum(p.numel() for p in model.parameters())
    assert all(p.requires_grad and p.numel() % N == 0 for p in model.parameters())
    expected = {  # (params, grads, optimizer) bytes per rank
        0: (2 * P, 2 * P, 12 * P),
        1: (2 * P, 2 * P, 12 * P // N),
        2: (2 * P, 2 * P // N, 12 * P // N),
        3: (2 * P // N, 2 * P // N, 12 * P // N),
    }
    totals = {0: 16 * P, 1: 4 * P + 12 * P // N, 2: 2 * P + 14 * P // N, 3: 16 * P // N}
    for rank_reports in reports:
        for stage in range(4):
            mem = rank_reports[stage]["mem"]
            assert (mem["params"], mem["grads"], mem["optimizer"]) == expected[stage], (stage, mem)
            assert mem["params"] + mem["grads"] + mem["optimizer"] == totals[stage]
            assert "offloaded" not in mem and mem["activations"] > 0
            # sharding changes no activation (ZeRO-3's whole parameters are not counted as such)
            assert mem["activations"] == rank_reports[0]["mem"]["activations"]
        for i, stage in enumerate((1, 2, 3)):
            offloaded = rank_reports[4 + i]
            mem = offloaded["mem"]
            # the masters and moments moved to the host pool; the same 12P/N bytes, none left behind
            assert mem["optimizer"] == 0 and mem["offloaded"] == 12 * P // N
            assert (mem["params"], mem["grads"]) == expected[stage][:2]
            # and the step computed there gives the same bits
            for name, value in offloaded["params"].items():
                assert torch.equal(value, rank_reports[stage]["params"][name]), (stage, name)

    # traffic per step, summed over ranks: stages 1 and 2 exactly plain DP's, stage 3 exactly 1.5x
    def total(stage, ops):
        return sum(r[stage]["comm"][-1]["dp"].get(op, 0) for r in reports for op in ops)

    dp = total(0, ["all_reduce"])
    assert dp == 2 * (N - 1) * 2 * P
    assert total(1, ["reduce_scatter", "all_gather"]) == dp
    assert total(2, ["reduce_scatter", "all_gather"]) == dp
    assert 2 * total(3, ["reduce_scatter", "all_gather"]) == 3 * dp

    # stage 3 without tied weights: never more than the two largest units whole at once
    for r in reports:
        units = sorted(r[3]["units"].values(), reverse=True)
        assert r[3]["tied_units"] == []
        # more than one unit (the prefetch overlaps), at most two
        assert units[0] < r[3]["peak_whole"] <= units[0] + units[1] < sum(units) / 2
