"""dualpipev's overlapped pairs (pipeline/expert_overlap.py) against the same pairs run one side after
the other: pp = 2, ep = 2 over dp = 2 (a world of 4), `tiny-moe` with 4 layers (one sparse block a
stage), m = 4, 3 steps.

The overlapped run takes turns between the pair's forward and backward at every expert exchange,
posted asynchronously as point-to-point batches through `Comm`; the serial run is the same runtime
with `overlap_pairs = False` (each pair's F then its B, the sparse blocks' own blocking
`all_to_all` dispatch of parallel/expert.py). Asserted: per-step losses and gradient norms and
every final parameter bit for bit equal, the same ep bytes per step, every pair run, and, counted
per exchange (pipeline/overlap.py), the other side of its pair computing while it was in flight for
exchanges inside the pairs and for none outside them (an exchange waited where it is posted). How much
time that hides is a clock's figure: bench/dualpipe_overlap.py prints it.
"""

import pytest

from tests.helpers import make_config

STEPS = 3
OVERRIDES = ["model.preset=tiny-moe", "model.layers=4", "train.global_batch=16", "train.seq_len=16",
             "train.lr=1e-3", "train.min_lr_ratio=1.0", "train.eps=1e-6", f"train.steps={STEPS}",
             "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "pipeline.schedule=dualpipev",
             "train.microbatches=4"]


def train_paired(overrides: list[str], out: str, overlapped: bool) -> dict:
    """Train with the pairs overlapped or serial; losses, norms, ep bytes, parameters, pair figures."""
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    runtime = trainer.parallel.pipeline
    runtime.overlap_pairs = overlapped
    runtime.dispatch.use(overlapped)  # serial: the sparse blocks' own dispatch (parallel/expert.py)
    records = trainer.run()
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "ep_bytes": [sum(r["comm"].get("ep", {}).values()) for r in records],
            "ep_ops": sorted({op for r in records for op in r["comm"].get("ep", {})}),
            "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()},
            "overlap": runtime.pair_overlap(), "pairs": runtime.pairs, "rank": trainer.mesh.global_rank}


def train_both(root: str) -> list[dict]:
    return [train_paired(OVERRIDES, f"{root}/{name}", flag) for name, flag in (("serial", False), ("overlap", True))]


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    return worlds(4).run(train_both, str(tmp_path_factory.mktemp("dualpipe_overlap")))


def test_overlapped_pairs_equal_serial_pairs_bitwise(runs):
    for serial, overlapped in runs:
        assert overlapped["losses"] == serial["losses"], serial["rank"]
        assert overlapped["norms"] == serial["norms"], serial["rank"]
        assert overlapped["params"].keys() == serial["params"].keys()
        for name, p in serial["params"].items():
            assert overlapped["params"][name].equal(p), f"rank {serial['rank']}: {name}"
        assert overlapped["ep_bytes"] == serial["ep_bytes"] and min(serial["ep_bytes"]) > 0


def test_exchanges_overlapped_only_inside_the_pairs(runs):
    for serial, overlapped in runs:
        assert serial["ep_ops"] == ["all_to_all", "all_to_all.splits"]  # the blocking dispatch
        assert overlapped["ep_ops"] == ["recv", "send"]  # point-to-point, through Comm (receives count 0 bytes)
        assert serial["overlap"]["pairs"] == overlapped["overlap"]["pairs"] == STEPS * len(serial["pairs"]) > 0
        got = overlapped["overlap"]
        assert 0 < got["exchanges"] < got["step"]["exchanges"], got  # the warm-up and cool-down run unpaired
        # a pair's two sides issue their exchanges in turn, each passing the turn on while its own is in
        # flight (a side whose partner has ended would wait where it posts); here both sides of every pair
        # exchange alike (a sparse block's dispatch and combine forward, their gradients backward): all 45
        assert got["switched"] == got["exchanges"], got
        assert got["step"]["switched"] == got["switched"], got  # none outside the pairs
        assert serial["overlap"]["step"]["exchanges"] == 0  # serial: the blocking dispatch, nothing posted apart
        assert 0 <= got["hidden_s"] <= got["in_flight_s"] and 0 <= got["step"]["hidden_s"] <= got["step"]["in_flight_s"]
