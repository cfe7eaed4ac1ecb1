"""`threefold.prepare` on three plain PyTorch models (batch norm; nn.TransformerEncoder; frozen, shared and
unused parameters) under dp, ZeRO-1 and ZeRO-3 on 2 and 4 gloo ranks, against the user's own loop
(torch.optim.AdamW): loss and every parameter and buffer within 1e-5 over 10 steps; a resume at step 5
equal bitwise to the uninterrupted run; the gradient bytes exactly those of the trainable parameters."""

import pytest
import torch

from tests.engine_tasks import reference, run
from tests.helpers import rel_err
from tests.zero_tasks import assemble
from threefold.comm import ring_chunk

MODELS = ["ConvBN", "ViT", "FrozenShared"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_engine_matches_plain_loop(worlds, tmp_path, name, n):
    ref = reference(name, n if name == "ConvBN" else 1)  # batch norm: each rank normalises its own share
    runs = [[f"parallel.zero={zero}"] for zero in (0, 1, 3)]
    if name == "ViT" and n == 2:  # accumulation and activation checkpointing by class under ZeRO-3 (and ZeRO-2)
        runs += [["parallel.zero=3", "train.microbatches=2", "remat.policy=full"],
                 ["parallel.zero=2", "train.microbatches=2"]]
    for overrides in runs:
        zero = int(overrides[0][-1])
        ckpt = str(tmp_path / f"ckpt{len(overrides)}{zero}") if n == 2 and zero in (1, 3) else None
        reports = worlds(n).run(run, name, overrides, ckpt)
        got = assemble([r["tensors"] for r in reports], [r["placements"] for r in reports])
        assert got.keys() == ref["tensors"].keys() - {"b.weight"}  # the shared weight once, as a.weight
        for key, want in ref["tensors"].items():
            if key in got and want.is_floating_point():
                err = rel_err(got[key], want.detach())
                assert err <= 1e-5, f"{name} n={n} zero={zero}: {key} differs from the plain loop by {err:.2e}"
        for a, b in zip(reports[0]["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, n, zero, reports[0]["losses"], ref["losses"])
        if ckpt is not None:  # resumed at step 5: bitwise the uninterrupted run
            assert reports[0]["resumed"] == reports[0]["losses"][5:]
            for r in reports:
                for key, t in r["tensors"].items():
                    assert torch.equal(r["resumed_state"][key], t), f"{name} zero={zero}: {key} after resume"
        if overrides == ["parallel.zero=0"]:  # plain dp all-reduces the trainable parameters once each: frozen ones never travel
            from tests.engine_tasks import build

            g = sum(p.numel() for p in build(name).parameters() if p.requires_grad)
            for rank, r in enumerate(reports):
                for comm in r["comm"]:
                    assert comm["dp"]["all_reduce"] == 2 * (g - ring_chunk(g, n, rank)) * 4 or \
                        _bucketed(comm["dp"]["all_reduce"], g, n)


def _bucketed(nbytes: int, g: int, n: int) -> bool:
    """Several buckets: each all-reduce's ring chunk is its own; the total is between the bounds."""
    return 2 * (g - -(-g // n)) * 4 * 0.9 <= nbytes <= 2 * g * 4


def test_refusals(worlds):
    from threefold.errors import ConfigError

    import threefold
    from tests.engine_tasks import build
    for bad, key in ((["parallel.tp=2"], "parallel.tp"), (["remat.policy=selective"], "remat.policy")):
        with pytest.raises(ConfigError, match=key):
            threefold.prepare(build("ViT"), torch.nn.CrossEntropyLoss(), bad)
