"""Context parallelism (cp) in the planner: memory per rank, the methods' bytes and time, the search, refusals.

docs/planner.md "Context parallelism"; the bytes are docs/context.md's "Bytes per attention call".
"""

from dataclasses import replace

import pytest

from threefold.cli import main
from threefold.config import load_config
from threefold.planner import context_comm
from threefold.planner.activations import Shape, block_items
from threefold.planner.comm import axis_link
from threefold.planner.context_comm import attention_seconds, cp_link
from threefold.planner.explain import layout_problems
from threefold.planner.hardware import PRESETS
from threefold.planner.memory import chunk_bytes, micro_shape, model_state_bytes, rank_memory
from threefold.planner.search import enumerate_strategies, search
from threefold.planner.step_time import _stage_compute, step_time
from threefold.planner.workload import Strategy, Workload, rank_chunks, rank_parameters

H100 = PRESETS["h100-80gb"]


def model(preset, seq):
    return replace(load_config(None, [f"model.preset={preset}"]).model, max_seq=seq)


LLAMA7B = model("llama-7b", 131072)  # 32 heads, 32 kv heads
LLAMA70B = model("llama-70b", 131072)  # 64 heads, 8 kv heads


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tp, sp", [(1, False), (4, True)])
def test_per_token_block_items_are_one_cp_th_of_the_whole_sequence(cp, tp, sp):
    """Every item a block saves is per local token (ulysses: head-sharded whole sequences, the same
    elements); ring adds its fp32 core output per token; allgather keeps the gathered K, V whole."""
    m, S = LLAMA70B, 32768
    whole = block_items(m, Shape(2, S, 2, tp, sp))
    for method in ("ring", "allgather", "ulysses"):
        part = block_items(m, Shape(2, S // cp, 2, tp, sp, cp, method))
        for key in ("norms", "attention_core", "mlp"):
            assert part[key] * cp == whole[key], (method, key)
    ulysses = block_items(m, Shape(2, S // cp, 2, tp, sp, cp, "ulysses"))
    assert {k: v * cp for k, v in ulysses.items()} == whole  # SDPA is_causal on whole sequences: no mask
    kv, heads, d = m.kv_heads // tp, m.heads // tp, m.head_dim
    allgather = block_items(m, Shape(2, S // cp, 2, tp, sp, cp, "allgather"))
    assert allgather["qkv"] == 2 * 2 * (S // cp) * d * heads + 2 * 2 * S * d * 2 * kv  # local q, the whole K and V
    assert allgather["cp_core"] == 4 * 2 * (S // cp) * heads * d  # fused blocks merged in fp32, as the ring's
    ring = block_items(m, Shape(2, S // cp, 2, tp, sp, cp, "ring"))
    assert ring["qkv"] * cp == whole["qkv"] and ring["cp_core"] == 4 * 2 * (S // cp) * heads * d


@pytest.mark.parametrize("cp", [2, 4])
def test_a_stage_saves_one_cp_th_of_its_activations(cp):
    """Through the strategy (micro_shape, chunk_bytes): a middle pipeline stage's blocks under ulysses keep
    exactly 1/cp of the cp = 1 bytes, but for the rotary tables (one cached pair at cp = 1, one per block
    of the local positions under cp); SDPA runs is_causal on the whole sequences and saves no mask."""
    w = Workload(LLAMA7B, 64, 32768)
    one = Strategy(dp=16, pp=4, microbatches=1, schedule="1f1b")
    split = replace(one, dp=16 // cp, cp=cp, cp_method="ulysses", microbatches=cp)  # the same micro-batch size
    assert split.micro_batch_size(w) == one.micro_batch_size(w) == 4
    assert micro_shape(w, split).s * cp == micro_shape(w, one).s == 32768
    chunk = rank_chunks(LLAMA7B, 4, 1)[0]  # no embedding, no head
    blocks = len(chunk.layers)
    tables = 4 * LLAMA7B.head_dim
    assert chunk_bytes(w, split, chunk) - blocks * tables * 32768 // cp == \
        (chunk_bytes(w, one, chunk) - tables * 32768) / cp


def test_parameters_are_replicated_over_cp_and_zero_shards_over_dp_times_cp():
    w = Workload(LLAMA7B, 16, 32768)
    st = Strategy(dp=2, cp=4, zero=3, cp_method="ring")
    count = rank_parameters(LLAMA7B, 1, 1, 0)
    mem = rank_memory(w, st)
    assert (mem.params, mem.grads, mem.optimizer) == model_state_bytes(count, "bf16", 3, 8)
    assert rank_memory(w, replace(st, zero=0)).params == count.total * 2  # whole on every cp rank


# ------------------------------------------------------------------ communication


def test_cp_groups_inside_a_node_when_tp_times_cp_fits_else_across():
    assert cp_link(H100, 2, 4).name == H100.nvlink and cp_link(H100, 8, 2).name == H100.infiniband
    # dp's groups stride over tp x cp; the gradients' dp+cp group is dp x cp ranks of stride tp
    assert axis_link(H100, "dp", 2, 2, 2, cp=2).name == H100.nvlink
    assert axis_link(H100, "dp", 2, 2, 2, cp=4).name == H100.infiniband
    assert axis_link(H100, "replica", 1, 2, 8, cp=4).name == H100.nvlink


def test_the_step_charges_every_blocks_attention_bytes_forward_and_backward():
    """pp = 1, no recomputation: the step's cp communication is layers x micro-batches x one call's
    (forward + backward) seconds, from theoretical_bytes; allgather's collectives are all exposed."""
    w = Workload(LLAMA70B, 8, 65536)
    st = Strategy(dp=1, tp=8, cp=8, microbatches=8, zero=3, cp_method="allgather", sequence_parallel=True)
    link = cp_link(H100, 8, 8)
    heads, kv, s, d = 64 // 8, 8 // 8, 65536 // 8, LLAMA70B.head_dim
    figures = context_comm.theoretical_bytes("allgather", 8, 1, heads, kv, s, d, 2, False)
    forward = sum(7 * link.latency_s + n / link.bytes_per_s for n in figures["forward"].values())
    backward = sum(7 * link.latency_s + n / link.bytes_per_s for n in figures["backward"].values())
    t = step_time(w, st, H100)
    assert t.cp_comm_s == pytest.approx(8 * LLAMA70B.layers * (forward + backward), rel=1e-12)
    assert t.cp_overlapped_s == 0
    # the ring sends the same K,V bytes (and the fp32 dK,dV) but hides its hops behind the block attention
    ring = step_time(w, replace(st, cp_method="ring"), H100)
    assert ring.cp_overlapped_s > 0 and ring.cp_comm_s < t.cp_comm_s
    # full recomputation sends the forward figures again
    full = step_time(w, replace(st, remat="full"), H100)
    assert full.cp_comm_s == pytest.approx(8 * LLAMA70B.layers * (2 * forward + backward), rel=1e-12)


def test_ring_hops_are_charged_max_of_compute_and_transfer():
    link = cp_link(H100, 8, 16)
    fast = attention_seconds("ring", 16, 1, 16, 1, 8192, 128, 2, link, attention_forward_s=1.0)
    assert fast.forward_hidden > 0 and fast.backward == 0  # every hop hidden: only the mask gather shows
    slow = attention_seconds("ring", 16, 1, 16, 1, 8192, 128, 2, link, attention_forward_s=0.0)
    hop = link.latency_s + context_comm.theoretical_bytes("ring", 16, 1, 16, 1, 8192, 128, 2, False)[
        "backward"]["send"] / 15 / link.bytes_per_s
    assert slow.backward == pytest.approx(15 * hop) and slow.backward_hidden == 0


def test_attention_compute_per_rank_is_one_cp_th():
    """The zigzag split balances the causal work: a rank's forward compute is 1/cp of the whole sequence's
    (the matmuls of 1/cp of the tokens, their queries against every key)."""
    w = Workload(LLAMA70B, 8, 65536)
    one = Strategy(dp=8, tp=8, microbatches=1, zero=3, sequence_parallel=True)
    split = replace(one, dp=1, cp=8, microbatches=8)  # one sequence per micro-batch, 1/8 of it per rank
    whole, part = _stage_compute(w, one, H100, 0)[0], _stage_compute(w, split, H100, 0)[0]
    assert part * 8 == pytest.approx(whole, rel=0.02)


# ------------------------------------------------------------------ the search


def test_a_long_sequence_that_fits_only_split_picks_cp():
    w = Workload(LLAMA7B, 8, 131072)
    r = search(w, 8, H100, {"tp": 1, "pp": 1, "zero": 3})
    assert r.feasible and r.best.strategy.cp > 1
    assert not any(c.fits for c in r.candidates if c.strategy.cp == 1)  # cp = 1: does not fit (111 GiB)
    assert r.best.as_dict()["train_overrides"] == [f"parallel.cp={r.best.strategy.cp}",
                                                   f"parallel.cp_method={r.best.strategy.cp_method}"]


def test_cp_stays_1_when_the_sequence_fits_without_it():
    w = Workload(model("gpt2-124m", 16384), 64, 16384)
    r = search(w, 8, H100, {"tp": 1, "pp": 1})
    assert any(c.strategy.cp > 1 and c.fits for c in r.candidates)  # evaluated, and slower
    assert r.best.strategy.cp == 1 and "cp" not in r.best.as_dict()


def test_short_sequences_do_not_search_cp_and_max_cp_bounds_it():
    short = Workload(model("llama-7b", 8192), 8, 8192)
    assert {st.cp for st in enumerate_strategies(short, 8, H100, {"tp": 1, "pp": 1})} == {1}
    long = Workload(LLAMA7B, 8, 131072)
    assert {st.cp for st in enumerate_strategies(long, 8, H100, {"tp": 1, "pp": 1})} == {1, 2, 4, 8}
    assert {st.cp for st in enumerate_strategies(long, 8, H100, {"tp": 1, "pp": 1, "max_cp": 2})} == {1, 2}
    assert {st.cp_method for st in enumerate_strategies(long, 8, H100, {"tp": 1, "pp": 1, "cp": 4})} == \
        {"ring", "allgather", "ulysses"}


def test_a_fixed_pipedream_2bw_is_planned_with_cp():
    """pipedream-2bw is never chosen for the user, but fixed it composes with cp as the config allows."""
    long = Workload(LLAMA7B, 8, 131072)
    plans = enumerate_strategies(long, 8, H100, {"tp": 1, "pp": 2, "schedule": "pipedream-2bw"})
    assert {st.schedule for st in plans} == {"pipedream-2bw"} and {st.cp for st in plans} == {1, 2, 4}


# ------------------------------------------------------------------ refusals


def test_a_sequence_not_divisible_by_2cp_is_refused():
    w = Workload(model("llama-7b", 4096), 8, 4000)
    assert enumerate_strategies(w, 6, H100, {"cp": 3}) == []
    assert any("not a multiple of 2 x cp = 6" in p for p in layout_problems(w, 6, H100, {"cp": 3}))


def test_ulysses_needs_heads_and_kv_heads_divisible_by_cp_times_tp():
    w = Workload(LLAMA70B, 8, 131072)  # 8 kv heads
    assert enumerate_strategies(w, 64, H100, {"tp": 8, "pp": 1, "cp": 8, "cp_method": "ulysses"}) == []
    assert any("8 kv heads are not both divisible by cp x tp = 64" in p
               for p in layout_problems(w, 64, H100, {"tp": 8, "pp": 1, "cp": 8, "cp_method": "ulysses"}))
    ok = enumerate_strategies(w, 64, H100, {"tp": 4, "pp": 1, "cp": 2, "cp_method": "ulysses"})
    assert ok and {st.cp_method for st in ok} == {"ulysses"}
    # searched freely, ulysses appears only where it splits
    assert all(st.cp * st.tp <= 8 for st in enumerate_strategies(w, 64, H100, {"pp": 1, "zero": 3, "remat": "full",
                                                                              "microbatches": 1})
               if st.cp_method == "ulysses" and st.cp > 1)


MOE = model("tiny-moe", 32768)


def test_a_mixture_of_experts_searches_cp_and_ep_together_routing_only_its_tokens():
    """Dropless MoE under cp (docs/context.md): searched with ep, and with tp (sequence parallel or not);
    nothing says 'not modelled'; a capacity is refused (the config's rule)."""
    w = Workload(MOE, 8, 32768)
    found = enumerate_strategies(w, 8, H100, {"pp": 1})
    assert {st.cp for st in found} == {1, 2, 4, 8}
    assert any(st.cp > 1 and st.ep > 1 for st in found)
    assert any(st.cp > 1 and st.tp > 1 and st.sequence_parallel for st in found)
    assert not any("not modelled" in p for p in layout_problems(w, 8, H100, {"cp": 2, "ep": 2, "dp": 4}))
    capped = Workload(replace(MOE, expert_capacity=1.25), 8, 32768)
    assert {st.cp for st in enumerate_strategies(capped, 8, H100, {"pp": 1})} == {1}
    assert any("dropless" in p for p in layout_problems(capped, 8, H100, {"cp": 2}))


def test_a_sparse_blocks_saves_are_one_cp_th_but_the_summed_balance():
    """The router, dispatched rows and experts' activations of a sparse block are per local token, so
    1/cp of the whole sequence's; the per-sequence balance, summed over cp, saves 4 b E more (8 b E); the
    grouped matmul's row offsets (4 E bytes) are per rank, whatever its tokens."""
    from threefold.planner.activations import sparse_block_items

    b, S, e = 2, 4096, MOE.experts
    whole = sparse_block_items(MOE, Shape(b, S, 2))
    for cp in (2, 4):
        part = sparse_block_items(MOE, Shape(b, S // cp, 2, 1, False, cp, "ring"))
        assert (part["mlp"] - 8 * b * e - 4 * e) * cp == whole["mlp"] - 4 * b * e - 4 * e


def test_expert_all_to_all_moves_the_local_tokens_and_the_routing_statistics_are_all_reduced():
    """Under (cp, ep) each rank's all-to-all carries its own 1/cp of every sequence's routed rows; each
    sparse block all-reduces its routing statistics over cp once per forward (small, counted)."""
    from threefold.planner import moe as planner_moe
    from threefold.planner.step_time import _cp_comm, _ep_comm

    w = Workload(replace(MOE, layers=4), 16, 32768)
    one = Strategy(dp=4, ep=4, microbatches=2)
    split = replace(one, cp=2)  # the same micro-batch of 2 sequences, half of each per rank
    ep_one, ep_split = _ep_comm(w, one, H100, 0), _ep_comm(w, split, H100, 0)
    rows = planner_moe.routed_rows(w.model, 2, 32768, 1, False)
    a2a = planner_moe.all_to_all_seconds(rows / 2, w.model, 2, 4, 1, H100)
    assert ep_split[0] == pytest.approx(2 * 4 * a2a) and ep_split[0] < ep_one[0]
    nbytes = planner_moe.routing_statistics_bytes(w.model, 2)
    assert nbytes == 4 * (2 * 2 * MOE.experts + 2 + MOE.experts + 1)
    stats = axis_link(H100, "cp", 1, 4, 2)
    from threefold.planner import comm as planner_comm
    f_with, b_with, _ = _cp_comm(w, split, H100, 4, 4)
    f_without, b_without, _ = _cp_comm(w, split, H100, 4, 0)
    assert f_with - f_without == pytest.approx(4 * planner_comm.all_reduce(nbytes, 2, stats))
    assert b_with == b_without  # its backward is the identity
    from threefold.planner.dp_comm import _groups  # experts' gradients over edp x cp (expert_replica_axis)
    ranks = lambda st: [(n, g.ranks) for n, g in _groups(st, H100, 1.0, 2.0)]  # noqa: E731
    assert ranks(split) == [(1.0, 8), (2.0, 2)] and ranks(one) == [(1.0, 4), (2.0, 1)]
    full = replace(split, remat="full")  # a recomputed sparse block all-reduces again
    assert _cp_comm(w, full, H100, 4, 4)[1] - _cp_comm(w, full, H100, 4, 0)[1] == pytest.approx(
        4 * planner_comm.all_reduce(nbytes, 2, stats))


def test_selective_recomputation_keeps_none_of_the_cores_cp_state():
    """remat.policy=selective recomputes the attention core, which under cp is the method's whole attention:
    the gathered K and V, the mask, ulysses' head-sharded output and the ring's fp32 output all go; what
    stays is the core's input (the local q, k, v) and the o projection's input, 1/cp of cp = 1's."""
    from threefold.planner.activations import block_bytes

    m, S, b = LLAMA70B, 32768, 2
    for tp, sp in ((1, False), (4, True)):
        whole = block_bytes(m, Shape(b, S, 2, tp, sp), "selective")
        for cp in (2, 4):
            for method in ("ring", "allgather", "ulysses"):
                part = block_bytes(m, Shape(b, S // cp, 2, tp, sp, cp, method), "selective")
                assert part * cp == whole, (tp, cp, method)
    # tiny at cp 2 (fp32, b 8, S 32; GPT: no RoPE): what the harness counts, 98,304 less than before
    # (allgather's gathered K, V and mask; ulysses' head-sharded output c b s a d, no mask: is_causal; both
    # the log-sum-exp 4 b a s)
    tiny = load_config(None, ["model.preset=tiny"]).model
    lse = 4 * 8 * 4 * 16
    for method, dropped in (("allgather", 49152 + lse), ("ulysses", 4 * 8 * 16 * 4 * 8 + lse)):
        x = Shape(8, 16, 4, 1, False, 2, method)
        assert block_bytes(tiny, x, "none") - block_bytes(tiny, x, "selective") == dropped, method


def test_hugging_face_llama_plans_cp_with_the_decoders_terms():
    """implementation=hf-llama under cp: its own items per local token, plus the method's terms of the core
    (the attention runs through threefold's seam): the search tries cp, nothing says 'not modelled'."""
    hf = replace(Workload(LLAMA7B, 8, 131072), implementation="hf-llama")
    found = enumerate_strategies(hf, 8, H100, {"cp": 2})
    assert found and all(st.cp == 2 for st in found)
    assert not any("not modelled" in p for p in layout_problems(hf, 8, H100, {"cp": 2}))
    one = block_items(LLAMA7B, Shape(1, 131072, 2), hf=True)
    allgather = block_items(LLAMA7B, Shape(1, 65536, 2, 1, False, 2, "allgather"), hf=True)
    d, a = LLAMA7B.head_dim, LLAMA7B.heads
    assert allgather["cp_core"] == 4 * 65536 * a * d  # its fused blocks merged in fp32
    assert allgather["qkv"] == 2 * 65536 * d * a + 2 * 131072 * d * 2 * a
    for key in ("norms", "attention_core", "mlp", "attention_out"):
        assert allgather[key] * 2 == one[key], key
    mem = rank_memory(hf, Strategy(dp=4, cp=2, microbatches=2, zero=3, remat="full"), H100)
    assert mem.total < rank_memory(hf, Strategy(dp=8, microbatches=1, zero=3, remat="full"), H100).total


def test_the_command_fixes_cp_and_says_why_a_layout_cannot_exist(capsys):
    code = main(["plan", "--model", "llama-7b", "--gpus", "6", "--cp", "3", "--seq-len", "4000"])
    assert code == 2 and "not a multiple of 2 x cp = 6" in capsys.readouterr().err
    code = main(["plan", "--model", "gpt2-124m", "--set", "model.max_seq=32768", "--seq-len", "32768", "--gpus", "8",
                 "--global-batch", "8", "--tp", "1", "--pp", "1", "--cp", "2", "--cp-method", "allgather",
                 "--zero", "1", "--activation-checkpointing", "none", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "cp=2 cp_method=allgather" in out and "train with --cp 2 --set parallel.cp_method=allgather" in out
