"""The planner on mixtures of experts: parameters per ep rank, expert FLOPs, saved bytes, all-to-all, ep search.

The saved bytes of a sparse block are also checked against real CPU runs of tiny-moe in
tests/distributed/test_planner_memory.py (to the byte, dropless)."""

from dataclasses import replace

import pytest
import torch

from threefold.config import load_config
from threefold.models.decoder import build_model
from threefold.models.moe import MoE
from threefold.observe.memory import SavedTensorMeter
from threefold.planner import comm
from threefold.planner.compute import model_flops_per_token
from threefold.planner.hardware import PRESETS
from threefold.planner.memory import model_state_bytes, rank_memory
from threefold.planner.moe import all_to_all_seconds, sparse_mlp_saved_bytes
from threefold.planner.search import search
from threefold.planner.workload import Strategy, Workload, active_parameters, rank_parameters

H100 = PRESETS["h100-80gb"]


def model(preset, *overrides):
    return load_config(None, [f"model.preset={preset}", *overrides]).model


def test_a_rank_holds_its_share_of_the_experts_of_the_built_model():
    m = model("tiny-moe", "model.shared_experts=1")
    net = build_model(m, 0)
    experts = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    whole = sum(p.numel() for p in net.parameters())
    for ep in (1, 2, 4):
        count = rank_parameters(m, 1, 1, 0, ep=ep)
        assert count.expert == experts / ep
        assert count.total == whole - experts + experts / ep
    # ZeRO-1: dense optimizer states over dp, the experts' over dp / ep (the ranks holding the same experts)
    count = rank_parameters(m, 1, 1, 0, ep=2)
    _, _, optim = model_state_bytes(count, "fp32", 1, 4, 2)
    assert optim == 8 * ((whole - experts) / 4 + experts / 2 / 2)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "deepseek-v3"])
def test_model_flops_count_only_the_active_experts(preset):
    m, s = model(preset), 4096
    norms = m.hidden * (2 * m.layers + 1)
    matmul = active_parameters(m) - m.vocab * m.hidden - norms  # the embedding does no matmul; the head does
    assert model_flops_per_token(m, s) == pytest.approx(3 * (2 * matmul + m.layers * 4 * s * m.hidden), rel=1e-12)


@pytest.mark.parametrize("changes,dtype", [((), torch.float32), (("model.experts_top_k=1",), torch.float32),
                                           (("model.shared_experts=1",), torch.bfloat16),
                                           (("model.mlp=gelu",), torch.float32)])
def test_saved_bytes_of_a_sparse_mlp_equal_what_autograd_keeps(changes, dtype):
    m = model("tiny-moe", *changes)
    moe = build_model(m, 0).blocks[0].mlp.to(dtype)  # router, experts and shared experts as the decoder builds them
    assert isinstance(moe, MoE)
    moe.experts.kernel = "grouped"  # the experts as a Hopper GPU runs them (the CPU's padded bmm saves padding)
    x = torch.randn(3, 16, m.hidden, dtype=dtype, requires_grad=True)
    meter = SavedTensorMeter(exclude=[x, *moe.parameters()])  # the input is the norm's output, counted there
    with meter.measure():
        moe(x)
    assert sparse_mlp_saved_bytes(m, 3, 16, x.element_size()) == meter.peak


def test_all_to_all_inside_a_node_and_across_nodes():
    m, rows, c = model("mixtral-8x7b"), 8192.0, 2
    sent = rows * m.hidden * c * 7 / 8  # 7 of 8 ranks' rows leave
    intra = comm.intra_link(H100)
    assert all_to_all_seconds(rows, m, c, 8, 1, H100) == pytest.approx(sent / intra.bytes_per_s + 7 * intra.latency_s)
    # tp=2: an ep group of 8 spans two nodes; half of the peers are behind the network port
    inter = comm.inter_link(H100)
    across = all_to_all_seconds(rows, m, c, 8, 2, H100)
    assert across == pytest.approx(sent * 4 / 7 / inter.bytes_per_s + 4 * inter.latency_s)
    assert across > 4 * all_to_all_seconds(rows, m, c, 8, 1, H100)
    assert all_to_all_seconds(rows, m, c, 1, 1, H100) == 0.0


def test_search_proposes_expert_parallelism_for_mixtral_where_it_wins():
    w = Workload(model("mixtral-8x7b"), 256, 4096)
    r = search(w, 16, H100)
    best = r.best
    assert best.strategy.ep > 1 and best.time.ep_comm_s > 0
    no_ep = [c for c in r.candidates if c.strategy.ep == 1]
    assert no_ep and all(not c.fits or c.tokens_per_s < best.tokens_per_s for c in no_ep)
    assert all(("does not fit" in c.why) or ("slower" in c.why) for c in no_ep)
    # the same layout without ep gathers every expert of a layer (ZeRO-3): more memory than with it
    st = replace(best.strategy, ep=1)
    assert rank_memory(w, st, H100).total > rank_memory(w, best.strategy, H100).total


def test_a_dense_model_is_not_offered_expert_parallelism():
    r = search(Workload(model("llama-7b"), 64, 2048), 16, H100)
    assert {c.strategy.ep for c in r.candidates} == {1}
    assert Strategy(ep=2, dp=4).edp == 2


class _Identity(torch.autograd.Function):  # an all-reduce over a group of one: a new tensor, identity backward
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Holders:
    """The `SequenceShards` of a sparse block that sees one of `size` parts of every sequence (cp or SP)."""

    def __init__(self, size):
        self.rank, self.size, self.reports = 0, size, True

    def sum(self, t):
        return _Identity.apply(t)


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (1, 2)])
def test_a_sparse_mlp_that_routes_its_part_of_each_sequence_saves_the_summed_balance_too(cp, tp):
    """Under context parallelism (or sequence parallelism) the router sees the rank's part of every sequence
    and sums the statistics over the holders (parallel/expert.py AxisSequenceShards): every item is the
    part's, and the summed mean probability is saved for its gradient too (4 b E more)."""
    m = model("tiny-moe")
    moe = build_model(m, 0).blocks[0].mlp
    moe.experts.kernel = "grouped"  # as a Hopper GPU runs them
    moe.sequence = _Holders(cp * tp)
    x = torch.randn(3, 16 // (cp * tp), m.hidden, requires_grad=True)
    meter = SavedTensorMeter(exclude=[x, *moe.parameters()])
    with meter.measure():
        moe(x)
    if cp > 1:
        assert sparse_mlp_saved_bytes(m, 3, 16 // cp, 4, cp=cp) == meter.peak
    else:
        assert sparse_mlp_saved_bytes(m, 3, 16, 4, tp, True) == meter.peak
