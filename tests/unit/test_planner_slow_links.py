"""The planner's slow-link terms: local SGD / DiLoCo meetings, quantized ZeRO-3 communication, hpZ, and the advice."""

import math
from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner import comm
from threefold.planner.dp_comm import MEETING_BYTES, QUANTIZED_BYTES, data_parallel
from threefold.planner.hardware import PRESETS
from threefold.planner.memory import rank_memory
from threefold.planner.search import search
from threefold.planner.slow_links import MIN_GAIN, advise
from threefold.planner.workload import Strategy, Workload, rank_parameters

H100 = PRESETS["h100-80gb"]


def slow(gbps):
    return replace(H100, inter_bytes_per_s=gbps / 8 * 1e9, infiniband=f"{gbps} Gb/s")


def llama7b(batch=256, seq=4096):
    return Workload(load_config(None, ["model.preset=llama-7b"]).model, batch, seq)


def test_a_meeting_every_h_steps_costs_one_fp32_all_reduce_over_h():
    w, gpu = llama7b(), slow(25)
    st = Strategy(dp=32, microbatches=8, sync_every=8)
    total, exposed = data_parallel(w, st, gpu, 0, 1.0, 0.5)
    group = comm.group(gpu, 1, 32)  # 32 dp ranks on 4 nodes (planner/comm.py Group)
    params = rank_parameters(w.model, 1, 1, 0).trainable
    buckets = math.ceil(MEETING_BYTES * params / (25 * 2**20))  # the runtime's buckets, a collective each
    assert total == exposed == pytest.approx(buckets * comm.group_all_reduce(MEETING_BYTES * params / buckets, group) / 8)


def test_quantized_zero3_and_hpz_move_fewer_bytes_and_keep_the_backward_gather_in_the_node():
    w, gpu = llama7b(), slow(25)
    base = Strategy(dp=32, zero=3, microbatches=32)
    n = rank_parameters(w.model, 1, 1, 0).total
    group = comm.group(gpu, 1, 32)  # 32 dp ranks on 4 nodes (planner/comm.py Group)
    units = w.model.layers + 3  # ZeRO-3 gathers and reduces each block, the embedding, the norm and the head
    unit = lambda op, nbytes, *g: units * op(nbytes / units, *g)  # noqa: E731
    t0, _ = data_parallel(w, base, gpu, 0, 0.0, 0.0)
    assert t0 == pytest.approx(32 * (2 * unit(comm.group_all_gather, 2 * n, group)
                                     + unit(comm.group_reduce_scatter, 2 * n, group)))
    t8, _ = data_parallel(w, replace(base, weight_comm="int8", grad_comm="int8"), gpu, 0, 0.0, 0.0)
    int8 = 1 + 4 / 256  # a byte per value and one fp32 scale per 256 (comm/quantize.py)
    assert QUANTIZED_BYTES == int8
    assert t8 == pytest.approx(32 * 3 * unit(comm.group_all_gather, int8 * n, group))
    hpz, _ = data_parallel(w, replace(base, hpz=True), gpu, 0, 0.0, 0.0)
    inside = unit(comm.all_gather, 2 * n, 8, comm.intra_link(gpu))  # 8 dp ranks per node
    assert hpz == pytest.approx(t0 + 32 * (inside - unit(comm.group_all_gather, 2 * n, group)))
    # memory: the secondary partition, the weights in 16 bits over the node's 8 dp ranks
    extra = rank_memory(w, replace(base, hpz=True), gpu).optimizer - rank_memory(w, base, gpu).optimizer
    assert extra == pytest.approx(2 * n / 8)


def test_recommended_on_a_slow_link_and_not_on_a_fast_one():
    w = llama7b()
    fast = advise(search(w, 32, H100))
    assert fast is not None and fast.option == "" and fast.best_gain < MIN_GAIN
    r = search(w, 32, slow(10))
    a = advise(r)
    assert a.option and a.gain >= MIN_GAIN and a.candidate.fits
    assert a.candidate.tokens_per_s == pytest.approx(r.best.tokens_per_s * (1 + a.gain))
    assert "Douillard et al. 2023" in a.risk and "slow links:" in a.describe(r.best)


def test_zero3_on_a_slow_link_gets_the_zero_plus_plus_options():
    w = llama7b()
    fixed = {"tp": 1, "pp": 1, "zero": 3, "remat": "full"}  # FSDP-style: every gather crosses the network
    assert advise(search(w, 32, H100, fixed)).option == ""
    # 10 Gb/s per GPU: NCCL's rings cross a node through its 8 NICs (planner/comm.py Group), so at 25 Gb/s the
    # gathers of llama-7b at 32 ranks already hide behind compute; at 10 they do not
    a = advise(search(w, 32, slow(10), fixed))
    assert a.option.startswith(("hpz", "int8")) and ("ZeRO++" in a.risk or a.option == "hpz")
    st = a.candidate.strategy
    assert st.zero == 3 and (st.weight_comm == "int8" or st.hpz) and st.sync_every == 1
