"""hpZ (parallel.zero_hpz) on two "nodes" of two processes: ZeRO-3's backward re-gather runs over
dp_intra only (bytes counted by Comm), the training is bit for bit ZeRO-3's and matches a plain
PyTorch loop; the layouts where hpZ cannot help are user errors."""

import pytest
import torch

from tests.distributed.test_reference import errors, reference_run
from tests.helpers import make_config
from tests.local_sgd_tasks import train_runs
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.models.decoder import build_model

BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=16", "train.steps=5", "train.lr=2e-3",
        "train.eps=1e-6", "train.grad_clip=0.5", "train.warmup_steps=2", "parallel.zero=3"]
INT8 = ["parallel.zero_weight_comm=int8", "parallel.zero_grad_comm=int8"]
HPZ = ["parallel.zero_hpz=true"]
N, L = 4, 2  # dp ranks, dp ranks per node
ELT = 4  # fp32


def padded_weights(n: int) -> int:
    """ZeRO-3's whole units: every parameter padded to a multiple of n elements."""
    model = build_model(make_config(BASE, "unused").model, seed=0)
    return sum(n * -(-p.numel() // n) for p in model.parameters())


def gathered(row: dict, axis: str) -> int:
    return row.get(axis, {}).get("all_gather", 0)


def test_hpz_keeps_the_backward_gather_inside_the_node(worlds, tmp_path, capsys):
    runs = [BASE, BASE + HPZ, BASE + INT8, BASE + INT8 + HPZ]
    per_rank = worlds(N).run(train_runs, [(r, str(tmp_path / f"run{i}")) for i, r in enumerate(runs)],
                             local_world_size=L)
    # the backward re-gathers exactly the values the forward gathered: bit for bit ZeRO-3 (also in 8 bits)
    for r in per_rank:
        for plain, hpz in ((0, 1), (2, 3)):
            rank = r[plain]["rank"]
            assert r[hpz]["losses"] == r[plain]["losses"], (rank, runs[hpz], r[hpz]["losses"], r[plain]["losses"])
            for k, v in r[plain]["params"].items():
                assert torch.equal(r[hpz]["params"][k], v), f"rank {rank} {runs[hpz]}: {k} differs"
    loss, norm, (param, worst) = errors([r[1] for r in per_rank], reference_run(BASE))
    line = f"hpZ against the plain PyTorch loop: loss {loss:.1e} grad norm {norm:.1e} params {param:.1e} ({worst})"
    assert loss <= 1e-5 and norm <= 1e-5 and param <= 1e-5, line
    # bytes per step: the forward's gather over dp, the backward's over dp_intra only, nothing on dp_inter
    w = padded_weights(N)
    for r in per_rank:
        for plain, hpz in ((0, 1), (2, 3)):
            for a, b in zip(r[plain]["comm"], r[hpz]["comm"], strict=True):
                assert gathered(b, "dp") * 2 == gathered(a, "dp") > 0, (a, b)  # ZeRO-3 gathers twice over dp
                assert gathered(b, "dp_intra") == (L - 1) * w // L * ELT, b  # the backward's, in fp32
                assert sum(b.get("dp_inter", {}).values()) == 0 and "dp_intra" not in a, (a, b)
                assert {k: v for k, v in b["dp"].items() if k != "all_gather"} == \
                       {k: v for k, v in a["dp"].items() if k != "all_gather"}
        assert r[0]["comm"][0]["dp"]["all_gather"] == 2 * (N - 1) * w // N * ELT
        assert r[1]["hpz_peak"] == r[3]["hpz_peak"] == w // L  # the node-local copy: all units, 1/L each
    fwd, bwd = gathered(per_rank[0][1]["comm"][0], "dp"), gathered(per_rank[0][1]["comm"][0], "dp_intra")
    with capsys.disabled():
        print(f"\n  {line}\n  hpZ bytes per step and rank: forward gather {fwd} over dp, backward {bwd} over "
              f"dp_intra (ZeRO-3: {2 * fwd} over dp); the copy holds {w // L} elements (the shard: {w // N})")


def hpz_layouts() -> list[str]:
    """secondary_partition's verdict on one node of four, and on four nodes of one."""
    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.parallel.hpz import secondary_partition

    out = []
    for node_size in (4, 1):
        try:
            secondary_partition(Comm(Mesh(Layout(dp=4), torch.device("cpu"), node_size)), pipelined=False)
            out.append("accepted")
        except ConfigError as e:
            out.append(f"{e.field}: {e}")
    return out


def test_hpz_where_it_cannot_help_is_a_user_error(worlds):
    one_node, one_per_node = worlds(N).run(hpz_layouts)[0]
    assert "parallel.zero_hpz" in one_node and "on one node" in one_node, one_node
    assert "parallel.zero_hpz" in one_per_node and "whole model on every rank" in one_per_node, one_per_node


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_hpz_without_zero3_names_the_key(stage):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"parallel.zero={stage}", "parallel.zero_hpz=true"]).validate(2)
    assert info.value.field == "parallel.zero_hpz" and "parallel.zero=3" in str(info.value)
