"""Planner layout search: a layout for Llama 70B on 64 H100 with reasons, clear answers when nothing fits."""

import json
import re

import pytest

from threefold.config import load_config
from threefold.planner.command import to_json
from threefold.planner.hardware import PRESETS
from threefold.planner.search import enumerate_strategies, search
from threefold.planner.workload import Workload

H100 = PRESETS["h100-80gb"]


def workload(preset, batch, seq=None):
    m = load_config(None, [f"model.preset={preset}"]).model
    return Workload(m, batch, seq or m.max_seq)


@pytest.fixture(scope="module")
def llama70b_on_64():
    return search(workload("llama-70b", 1024), 64, H100)


def test_llama_70b_on_64_h100_finds_a_layout(llama70b_on_64):
    r = llama70b_on_64
    assert r.feasible and r.best.fits
    st = r.best.strategy
    assert st.dp * st.tp * st.pp == 64
    assert r.best.memory.total <= H100.memory_bytes
    assert 0.2 < r.best.mfu < 0.6  # a sane share of the H100 peak
    fitting = [c for c in r.candidates if c.fits]
    assert [c.tokens_per_s for c in fitting] == sorted((c.tokens_per_s for c in fitting), reverse=True)


def test_alternatives_say_why_they_lose_with_numbers(llama70b_on_64):
    r = llama70b_on_64
    slower = [c for c in r.candidates[1:] if c.fits]
    short = [c for c in r.candidates if not c.fits]
    assert slower and short
    for c in slower:
        pct = float(re.match(r"([\d.]+)% slower", c.why).group(1))
        assert pct == pytest.approx(100 * (r.best.tokens_per_s / c.tokens_per_s - 1), abs=0.06)
    for c in short:
        more = float(re.search(r"([\d.]+) GiB more than the 80.0 GiB", c.why).group(1))
        assert more == pytest.approx((c.memory.total - H100.memory_bytes) / 2**30, abs=0.06)
    # plain data parallelism over 64 GPUs cannot hold 16 bytes per parameter of a 69B model
    dp_only = next(c for c in short if (c.strategy.dp, c.strategy.zero) == (64, 0))
    assert dp_only.memory.model_states >= 16 * 68.9e9
    doc = json.loads(json.dumps(to_json(r)))
    first = doc["candidates"][0]
    assert {"dp", "tp", "pp", "zero", "microbatches", "activation_checkpointing", "memory_bytes", "fits",
            "step_time_s", "tokens_per_s", "mfu"} <= set(first)
    assert set(first["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}


def test_a_model_that_fits_nowhere_says_what_is_short_and_by_how_much():
    r = search(workload("llama-405b", 64), 8, PRESETS["a100-40gb"])
    assert not r.feasible and r.best is None
    assert re.search(r"fits no layout of 8 x a100-40gb: .* needs [\d.]+ GiB per GPU of 40.0 GiB, short by [\d.]+ GiB",
                     r.message)
    need = int(re.search(r"at least (\d+) a100-40gb GPUs", r.message).group(1))
    assert 16 * 405e9 / need < 40 * 2**30  # the suggested count holds the sharded model states
    assert all(not c.fits and "does not fit" in c.why for c in r.candidates)


def test_fixed_knobs_are_not_searched():
    r = search(workload("llama-7b", 256), 16, H100, {"tp": 2, "pp": 2, "zero": 1, "remat": "full"})
    assert r.feasible
    assert {(c.strategy.tp, c.strategy.pp, c.strategy.zero, c.strategy.remat) for c in r.candidates} == \
        {(2, 2, 1, "full")}


def test_the_space_respects_heads_nodes_layers_and_batch():
    w = workload("llama-70b", 96)
    for st in enumerate_strategies(w, 64, H100):
        assert st.tp <= 8 and w.model.kv_heads % st.tp == 0 and st.pp <= w.model.layers
        assert w.global_batch % (st.dp * st.microbatches) == 0
        assert st.sequence_parallel == (st.tp > 1)
    # ZeRO 0-3 at every dp, one replica included (optimizer offload needs ZeRO >= 1)
    assert {(st.dp, st.zero) for st in enumerate_strategies(w, 8, H100) if st.dp == 1} == {(1, z) for z in range(4)}


def test_every_interleaving_depth_that_divides_the_blocks_per_rank_is_searched():
    """Real runs interleave 3-23 chunks per rank; the search once tried v = 2 only."""
    from threefold.planner.search import interleaving_depths
    assert interleaving_depths(80, 8) == [2, 5, 10]
    assert interleaving_depths(126, 16) == [2, 4, 7]  # 7 or 8 blocks per rank: both roundings' divisors
    assert interleaving_depths(105, 35) == [3]  # Megatron-LM's 530B: one block per chunk
    assert interleaving_depths(2, 2) == []
    w = Workload(load_config(None, ["model.preset=llama-70b"]).model, 64, 4096)
    space = enumerate_strategies(w, 64, PRESETS["h100-80gb"], {"tp": 8, "pp": 8, "schedule": "interleaved", "zero": 0,
                                                              "remat": "none"})
    assert sorted({st.virtual_stages for st in space}) == [2, 5, 10]
    best = search(w, 64, PRESETS["h100-80gb"], fixed={"tp": 8, "pp": 8, "schedule": "interleaved"}).best
    assert best.strategy.virtual_stages == 5, best.strategy.label()  # v=10 needs more memory than 80 GB


def test_the_v_schedules_are_searched_with_their_placement():
    """zb-v and dualpipev hold stages r and 2p-1-r on rank r: rank 0 has the embedding and the head."""
    from threefold.planner.workload import Strategy, rank_chunks
    m = load_config(None, ["model.preset=llama-7b"]).model
    chunks = rank_chunks(m, 4, 0, 2, "v")
    assert [c.first for c in chunks] == [True, False] and [c.last for c in chunks] == [False, True]
    assert Strategy(pp=4, schedule="zb-v").chunks == 2 and Strategy(pp=4, schedule="zb-v").placement == "v"
    w = workload("llama-7b", 64)
    space = enumerate_strategies(w, 16, H100, {"pp": 4, "tp": 1})
    names = {st.schedule for st in space}
    assert {"zb-v", "dualpipev", "zb-h1", "1f1b"} <= names and "pipedream-2bw" not in names
    assert all(st.microbatches >= 8 for st in space if st.schedule == "dualpipev")  # its check: m >= 2p
    best = search(w, 16, H100, fixed={"pp": 4}).best
    assert best.strategy.placement == "v", best.strategy.label()  # a V schedule wins (dualpipev today)
