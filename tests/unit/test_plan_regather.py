"""The sequence-parallel regather in the planner's step time follows where the runtime issues it
(parallel/sequence_region.py SequenceRegion; planner/compute.py `regather_cover_seconds`): at a region's backward
start, under its row-parallel linear's gradients, the attention's (or activation's) backward and the
first consumer's input gradient; under the first consumer's input gradient alone in a checkpointed block
(its shard is recomputed, autograd reaches v and up first); inside the fused linears' backward for
Megatron-LM; all of it exposed for software that does not overlap it."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner import comm
from threefold.planner.compute import gemm_seconds, regather_cover_seconds
from threefold.planner.hardware import PRESETS
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload

H100 = PRESETS["h100-80gb"]


def llama70b():
    return load_config(None, ["model.preset=llama-70b"]).model


def test_covers_are_the_runtimes_work():
    m = llama70b()
    cover = regather_cover_seconds(m, 1, 4096, 8, "flash", H100, "bf16")
    e = H100.compute_efficiency
    v_dgrad = gemm_seconds(4096, m.hidden, m.kv_heads * m.head_dim // 8, H100) / e
    up_dgrad = gemm_seconds(4096, m.hidden, m.ffn_hidden // 8, H100) / e
    assert cover["consumer"] == pytest.approx((v_dgrad, up_dgrad))
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim // 8
    assert cover["linear"] == pytest.approx((gemm_seconds(4096, m.hidden, qkv, H100) / e,
                                             gemm_seconds(4096, m.hidden, 2 * m.ffn_hidden // 8, H100) / e))
    # the region's backward hides more than any single linear's input gradient
    assert all(r > lin > c for r, lin, c in zip(cover["region"], cover["linear"], cover["consumer"]))


def _tp_seconds(regather: str, remat: str = "none", micro_batches: int = 8) -> float:
    w = Workload(llama70b(), micro_batches, 4096, regather=regather)  # one sequence per micro-batch
    st = Strategy(dp=1, tp=8, pp=8, microbatches=micro_batches, sequence_parallel=True, remat=remat)
    return step_time(w, st, H100).tp_comm_s


def test_exposed_regather_by_where_it_is_issued():
    m = llama70b()
    nbytes = 2 * 1 * 4096 * m.hidden
    link = comm.axis_link(H100, "tp", 8, 1, 8)
    gather = comm.all_gather(nbytes, 8, link)
    layers, micro = m.layers // 8, 8
    exposed, region, linear = (_tp_seconds(k) for k in ("exposed", "region", "linear"))
    cover = regather_cover_seconds(m, 1, 4096, 8, "flash", H100, "bf16")
    # software that does not overlap it pays both regathers of every block
    assert exposed - region == pytest.approx(micro * layers * 2 * gather - micro * layers * sum(
        max(0.0, gather - r) for r in cover["region"]), rel=1e-9)
    assert exposed - linear == pytest.approx(micro * layers * sum(min(gather, c) for c in cover["linear"]), rel=1e-9)
    assert region <= linear < exposed
    # a fully recomputed block's shard comes back with the recomputation: only v's and up's input gradient hide it
    full, full_exposed = _tp_seconds("region", "full"), _tp_seconds("exposed", "full")
    assert full_exposed - full == pytest.approx(micro * layers * sum(min(gather, c) for c in cover["consumer"]),
                                                rel=1e-9)


def test_every_k_mixes_the_two():
    region_none = _tp_seconds("region", "every-k") - _tp_seconds("exposed", "every-k")
    region_full = _tp_seconds("region", "full") - _tp_seconds("exposed", "full")
    plain = _tp_seconds("region") - _tp_seconds("exposed")
    assert plain < region_none < region_full <= 0  # more hidden without recomputation, least when all blocks redo
