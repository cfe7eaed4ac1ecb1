"""The two knobs the search settles per family (planner/search.py `_refine`, docs/planner.md "Slow
links"): ZeRO-3's hpZ - a secondary weight copy sharded over the dp ranks of one node, the group the
runtime builds (parallel/hpz.py) - and sequence parallelism, kept only where it pays."""

import json
from dataclasses import replace

import pytest

from threefold.cli import main
from threefold.config import load_config
from threefold.planner.explain import parse_layout
from threefold.planner.hardware import PRESETS
from threefold.planner.search import evaluate, hpz_group, search
from threefold.planner.workload import Strategy, Workload, total_parameters

H100 = PRESETS["h100-80gb"]


def llama7b(batch=256, seq=4096):
    return Workload(load_config(None, ["model.preset=llama-7b"]).model, batch, seq)


def slow(gbps):
    return replace(H100, inter_bytes_per_s=gbps / 8 * 1e9, infiniband=f"{gbps} Gb/s")


def test_hpz_group_is_the_node_share_of_dp_where_the_runtime_builds_one():
    assert hpz_group(Strategy(dp=32, zero=3), H100) == 8
    assert hpz_group(Strategy(dp=8, tp=2, pp=2, zero=3), H100) == 4
    assert hpz_group(Strategy(dp=8, zero=3), H100) == 0  # one node: the runtime refuses
    assert hpz_group(Strategy(dp=4, tp=8, zero=3), H100) == 0  # one dp rank per node
    assert hpz_group(Strategy(dp=32, zero=1), H100) == 0  # ZeRO-3 only


def test_search_chooses_hpz_on_a_slow_link_and_counts_its_copy():
    # 10 Gb/s per GPU: a node's 8 ranks cross through 8 such NICs (planner/comm.py `Group`); at 25 the
    # gathers hide behind the compute and the search rightly keeps plain ZeRO-3
    w, gpu = llama7b(), slow(10)
    fixed = {"tp": 1, "pp": 1, "zero": 3, "remat": "full"}  # FSDP-style: every gather crosses the network
    best = search(w, 32, gpu, fixed).best
    st = best.strategy
    assert st.hpz and best.hpz_group == 8
    plain = evaluate(w, replace(st, hpz=False), gpu)
    # parameters and gradients stay sharded over all 32; the copy is the 16-bit weights over the node's 8
    assert best.memory.params == plain.memory.params and best.memory.grads == plain.memory.grads
    assert best.memory.optimizer - plain.memory.optimizer == pytest.approx(best.hpz_bytes)
    assert best.hpz_bytes == pytest.approx(2 * total_parameters(w.model) / 8)
    # the backward's gather leaves the network: less data-parallel time, a faster step
    assert best.time.dp_comm_s < plain.time.dp_comm_s and best.tokens_per_s > plain.tokens_per_s
    d = best.as_dict()
    assert d["hpz"] is True and d["hpz_group"] == 8 and d["hpz_secondary_bytes"] == round(best.hpz_bytes)
    assert plain.as_dict()["hpz"] is False and plain.as_dict()["hpz_group"] is None


def test_hpz_not_chosen_where_the_runtime_refuses_it():
    r = search(llama7b(), 8, slow(25), {"tp": 1, "pp": 1, "zero": 3})  # one node
    assert all(not c.strategy.hpz for c in r.candidates)


def test_explain_fixes_hpz_and_prints_the_shard_groups(capsys):
    assert parse_layout("dp=32 tp=1 pp=1 zero=3 hpz nosp") == {"dp": 32, "tp": 1, "pp": 1, "zero": 3, "hpz": True,
                                                                "sequence_parallel": False}
    fixed = ["--tp", "1", "--pp", "1", "--zero", "3", "--activation-checkpointing", "full"]
    args = ["plan", "--model", "llama-7b", "--gpus", "32", "--global-batch", "256", "--seq-len", "4096",
            "--inter-gbps", "10", *fixed, "--explain", "dp=32 hpz"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["explain"]["candidate"]["hpz"] is True and out["explain"]["candidate"]["hpz_group"] == 8
    assert out["candidates"][0]["hpz"] is True  # the search's own choice too
    assert main(args) == 0
    assert "hpZ secondary weights over the 8 dp ranks of a node" in capsys.readouterr().out


def test_explain_hpz_where_it_cannot_run_says_why(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--global-batch", "64", "--seq-len", "2048",
                 "--tp", "1", "--pp", "1", "--zero", "1", "--explain", "dp=8 tp=1 pp=1 zero=3 hpz"]) == 0
    assert "hpz needs dp=8 to span more than one node" in capsys.readouterr().out


def test_sequence_parallelism_only_where_it_pays():
    """SP re-gathers each region's saved shard in the backward (time) and runs the norms on 1/tp of the
    tokens (saved time): the search keeps whichever is faster where both fit. On NVLink SP pays; over a
    link 20x slower (PCIe class) the extra gather costs more than it saves and the search leaves it
    off; where the layout fits only with it, it stays on."""
    w = llama7b(64, 2048)
    for gpu, sp in ((H100, True), (replace(H100, intra_bytes_per_s=H100.intra_bytes_per_s / 20), False)):
        best = search(w, 8, gpu, {"tp": 2, "pp": 1, "zero": 1}).best
        assert best.strategy.sequence_parallel is sp, gpu.intra_bytes_per_s
        flipped = evaluate(w, replace(best.strategy, sequence_parallel=not sp), gpu)
        assert flipped.fits and flipped.tokens_per_s < best.tokens_per_s  # the other choice fits, and is slower
    w70 = Workload(load_config(None, ["model.preset=llama-70b"]).model, 1024, 4096)
    fixed = dict(dp=4, tp=4, pp=4, zero=1, remat="none", schedule="zb-v", microbatches=256)
    slow = replace(H100, intra_bytes_per_s=H100.intra_bytes_per_s / 20)  # where SP costs time
    tight = search(w70, 64, slow, fixed).best
    off = evaluate(w70, replace(tight.strategy, sequence_parallel=False), slow)
    assert tight.strategy.sequence_parallel and not off.fits and off.tokens_per_s > tight.tokens_per_s
