"""The planner's memory prediction against the bytes real CPU runs count (metrics `mem`).

Each case trains one step of the reference model and compares every rank's counted bytes
(observe/memory.py: parameter, gradient and optimizer storages; bytes autograd saves for
backward, per pipeline micro-batch in flight) with `predict_memory(cfg, world_size, rank=r)`.
The Hugging Face cases build transformers' LlamaForCausalLM from a small config (random weights,
nothing downloaded), split it with threefold's tensor plan and count what one forward saves.
All cases of one world size run in one call of that shared world (a step of a tiny model takes
a fraction of a second; starting processes is what costs).

Requirement: within 5% of every counted part (1% for the Hugging Face cases, where one missed
tensor per layer is only ~3%). Today every case but the expert-parallel ones matches to the byte
(moe-dp2-ep2-zero1 and moe-dp2-cp2-ep2-zero1: which rank receives how many routed rows depends on the
data, within 3% and 3.8% per rank; the ranks' mean is the prediction to the byte, `BALANCED`; and Muon's
optimizer bytes under ZeRO-1, whose per-rank split is where the bucket's cut falls, `OPTIMIZER_MEAN`):
PLANNER_MEMORY_TOLERANCE=0 checks that. The cp cases also check the 1/cp law against their cp = 1 runs.
"""

import os

import pytest

from tests.helpers import make_config, train_and_report
from threefold.planner.memory import predict_memory, stage_memory
from threefold.planner.workload import Strategy, Workload, hf_llama_model

TOLERANCE = float(os.environ.get("PLANNER_MEMORY_TOLERANCE", "0.05"))  # 0 checks the "to the byte" claim
HF_TOLERANCE = min(TOLERANCE, 0.01)  # one (b, s, h) tensor per layer is ~3% of these tiny models: catch it

TINY = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32"]
LLAMA = ["model.preset=tiny-llama", "train.global_batch=8", "train.seq_len=32"]
MOE = ["model.preset=tiny-moe", "train.global_batch=8", "train.seq_len=32"]
PP = ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=32", "parallel.pp=2",
      "train.microbatches=4"]

CP_METHODS = ("ring", "allgather", "ulysses")
CASES = {  # world size -> {id: config overrides}
    1: {
        "tiny-dp1": ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16"],
        "llama-gqa-m2": ["model.preset=tiny-llama", "train.global_batch=4", "train.seq_len=64", "train.microbatches=2"],
        "small-bf16-every-k": ["model.preset=small", "train.global_batch=2", "train.seq_len=64", "precision.compute=bf16",
                               "remat.policy=every-k", "remat.every=3"],
        "llama-loss-chunk-sequence": ["model.preset=tiny-llama", "train.global_batch=4", "train.seq_len=32",
                                      "model.loss_chunk=16"],
        # mixtures of experts (dropless: every assignment kept, so the saved bytes are known in advance)
        "moe": ["model.preset=tiny-moe", "train.global_batch=4", "train.seq_len=32"],
        "moe-shared-top1-bf16-m2": ["model.preset=tiny-moe", "train.global_batch=4", "train.seq_len=32",
                                    "model.shared_experts=1", "model.experts_top_k=1", "precision.compute=bf16",
                                    "train.microbatches=2"],
        "moe-every-2-remat-every-k": ["model.preset=tiny-moe", "model.layers=4", "model.moe_every=2",
                                      "train.global_batch=4", "train.seq_len=32", "remat.policy=every-k"],
        # activation offload: device bytes of the other blocks, host bytes of the offloaded ones
        "offload-selective-m2": ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16",
                                 "train.microbatches=2", "remat.policy=selective", "remat.offload=cpu"],
        "llama-offload-1-2-every-k": ["model.preset=tiny-llama", "model.layers=4", "train.global_batch=4",
                                      "train.seq_len=16", "remat.policy=every-k", "remat.offload=cpu",
                                      "remat.offload_blocks=1-2"],
        # the cp = 1 runs of the cp cases (the same global batch and sequence: the 1/cp law below)
        "cp1": TINY,
        "llama-cp1": LLAMA,
        # the optimizer's states from its registry entry (planner/optimizer.py); mxfp8's linears save bf16's
        "muon": [*TINY, "train.optimizer=muon"],
        "sgd": [*TINY, "train.optimizer=sgd"],
        "mxfp8-all": [*TINY, "precision.compute=mxfp8", "precision.fp8_linears=all",
                      "precision.fp8_skip_first_last=false"],
    },
    2: {
        "dp2-m2": [*TINY, "train.microbatches=2"],
        "dp2-untied-nobias": ["model.preset=tiny", "train.global_batch=4", "train.seq_len=64", "model.bias=false",
                              "model.tie_embeddings=false"],
        "llama-mha-dp2": ["model.preset=tiny-llama", "train.global_batch=8", "train.seq_len=16", "model.kv_heads=4"],
        "zero1": [*TINY, "parallel.zero=1"],
        "zero2": [*TINY, "parallel.zero=2"],
        "zero3": [*TINY, "parallel.zero=3"],
        "bf16-zero1": [*TINY, "parallel.zero=1", "precision.compute=bf16"],
        "fp16-zero2-selective": [*TINY, "parallel.zero=2", "precision.compute=fp16", "remat.policy=selective"],
        "remat-full": [*TINY, "remat.policy=full"],
        "remat-every-2": [*TINY, "model.layers=4", "remat.policy=every-k"],
        "tp2": [*TINY, "parallel.tp=2"],
        "tp2-sp": [*TINY, "parallel.tp=2", "parallel.sequence_parallel=true"],
        "llama-tp2-sp-bf16": [*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true", "precision.compute=bf16"],
        "llama-tp2-sp-selective": [*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true",
                                   "remat.policy=selective"],
        "moe-dp2-ep2-zero1": ["model.preset=tiny-moe", "train.global_batch=8", "train.seq_len=32", "parallel.ep=2",
                              "parallel.zero=1"],
        "pp2-1f1b": PP,
        "pp2-gpipe": [*PP, "pipeline.schedule=gpipe"],
        "pp2-zb-h1": [*PP, "pipeline.schedule=zb-h1"],
        "pp2-interleaved": [*PP, "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
        "pp2-interleaved-selective-bf16": [*PP, "pipeline.schedule=interleaved", "pipeline.virtual_stages=2",
                                           "remat.policy=selective", "precision.compute=bf16"],
        "pp2-gpipe-full-untied": [*PP, "pipeline.schedule=gpipe", "remat.policy=full", "model.tie_embeddings=false"],
        "pp2-1f1b-every-2-m8": ["model.preset=tiny", "model.layers=6", "train.global_batch=16", "train.seq_len=16",
                                "parallel.pp=2", "train.microbatches=8", "remat.policy=every-k"],
        "llama-pp2-zb-h1-one-row": ["model.preset=tiny-llama", "model.layers=4", "train.global_batch=4",
                                    "train.seq_len=32", "parallel.pp=2", "train.microbatches=4",
                                    "pipeline.schedule=zb-h1"],
        "dp2-loss-chunk-rows": [*TINY, "model.loss_chunk=48"],
        "tp2-sp-loss-chunk": [*TINY, "parallel.tp=2", "parallel.sequence_parallel=true", "model.loss_chunk=32"],
        "pp2-1f1b-loss-chunk": [*PP, "model.loss_chunk=16"],
        "pp2-zb-h1-offload": [*PP, "pipeline.schedule=zb-h1", "remat.offload=cpu", "remat.offload_blocks=0,3"],
        "tp2-sp-offload": [*TINY, "parallel.tp=2", "parallel.sequence_parallel=true", "remat.offload=cpu"],
        # context parallelism: each rank holds 1/cp of every sequence (CP below: the 1/cp law)
        **{f"cp2-{m}": [*TINY, "parallel.cp=2", f"parallel.cp_method={m}"] for m in CP_METHODS},
        **{f"llama-cp2-{m}": [*LLAMA, "parallel.cp=2", f"parallel.cp_method={m}"] for m in CP_METHODS},
        # selective recomputation under cp: the recomputed core keeps none of the method's state
        **{f"cp2-{m}-selective": [*TINY, "parallel.cp=2", f"parallel.cp_method={m}", "remat.policy=selective"]
           for m in ("allgather", "ulysses")},
        # a mixture of experts under cp: each rank routes its own zigzag part of every sequence
        "moe-cp2-ring": [*MOE, "parallel.cp=2"],
        "moe-cp2-ulysses-selective": [*MOE, "parallel.cp=2", "parallel.cp_method=ulysses", "remat.policy=selective"],
        # Muon's momentum on the hidden matrices' ZeRO ranges and tp boxes, AdamW's moments on the rest
        "muon-zero1": [*TINY, "parallel.zero=1", "train.optimizer=muon"],
        "muon-tp2-zero3": [*TINY, "parallel.tp=2", "parallel.zero=3", "train.optimizer=muon"],
    },
    4: {
        "dp4": TINY,
        "small-llama-dp4-m2": ["model.preset=small", "train.global_batch=8", "train.seq_len=32", "train.microbatches=2",
                               "model.mlp=swiglu", "model.norm=rmsnorm", "model.position=rope"],
        "dp2-pp2-zero1": [*PP, "parallel.zero=1", "train.microbatches=2"],
        "tp2-sp-dp2-zero3": [*TINY, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3"],
        "pp4-zb-h1-m8": ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=16",
                         "parallel.pp=4", "train.microbatches=8", "pipeline.schedule=zb-h1"],
        **{f"cp4-{m}": [*TINY, "parallel.cp=4", f"parallel.cp_method={m}"] for m in CP_METHODS},
        "llama-cp4-ring": [*LLAMA, "parallel.cp=4"],
        "llama-cp4-allgather": [*LLAMA, "parallel.cp=4", "parallel.cp_method=allgather"],
        "moe-dp2-cp2-ep2-zero1": [*MOE, "parallel.cp=2", "parallel.ep=2", "parallel.zero=1"],  # EP: see BALANCED
    },
}

HF = dict(vocab_size=250, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64)
HF_CASES = {  # world size (= tp) -> [(config changes, batch, seq, sequence parallel, dtype)]
    1: [({}, 2, 16, False, "float32"), ({"num_key_value_heads": 4}, 3, 32, False, "bfloat16")],
    2: [({}, 2, 16, False, "float32"), ({}, 2, 16, True, "float32"), ({}, 3, 32, True, "bfloat16")],
    4: [({}, 2, 16, True, "float32")],  # kv heads replicated, vocabulary padded to 252
}


def count_all(cases: dict, out: str) -> dict:
    """Each case's memory record after one step, the experts run as a Hopper GPU runs them (one grouped
    matmul: the CPU's padded bmm would save the padding of this step's uneven routing)."""
    import threefold.models.moe as moe

    kernel, moe.expert_kernel = moe.expert_kernel, lambda *args: "grouped"
    try:
        return {name: train_and_report([*overrides, "train.steps=1"], f"{out}/{name}")["records"][-1]["mem"]
                for name, overrides in cases.items()}
    finally:
        moe.expert_kernel = kernel


def hf_saved_bytes(cases: list) -> list[int]:
    """Bytes one forward of a transformers Llama (split over the world as tp) saves for backward."""
    import torch
    import torch.distributed as dist
    import transformers

    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.models.hf_plans import llama_plan
    from threefold.observe.memory import SavedTensorMeter
    from threefold.parallel.tensor_plan import parallelize_tensor

    tp = dist.get_world_size()
    mesh = Mesh(Layout(tp=tp), torch.device("cpu"))
    comm = Comm(mesh)
    out = []
    for changes, batch, seq, sp, dtype in cases:
        config = transformers.LlamaConfig(**{**HF, **changes})
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
        if tp > 1:
            parallelize_tensor(model, mesh, comm, llama_plan(config, tp), sp)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        meter = SavedTensorMeter(exclude=list(model.parameters()) + list(model.buffers()))
        with meter.measure():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        out.append(meter.peak)
    return out


def _check(predicted: dict, counted: dict, where: str, tolerance: float = TOLERANCE) -> None:
    for key, value in counted.items():
        if value:
            err = abs(predicted[key] / value - 1)
            assert err <= tolerance, f"{where} {key}: predicted {predicted[key]} vs counted {value} ({err:.1%})"


_COUNTED: dict[int, list[dict]] = {}  # world size -> per rank, {case: counted bytes}: one run per session


def counted_bytes(worlds, size: int, out: str) -> list[dict]:
    """Every rank's counted bytes of every case of world `size` (run once; the 1/cp law reads them again)."""
    if size not in _COUNTED:
        cases = CASES[size]
        names = list(cases)
        results = [{} for _ in range(size)]
        for i in range(0, len(names), 6):  # a few cases per call: each call has the world's time limit
            chunk = {n: cases[n] for n in names[i:i + 6]}
            for rank, counted in enumerate(worlds(size).run(count_all, chunk, out)):
                results[rank].update(counted)
        _COUNTED[size] = results
    return _COUNTED[size]


# Expert parallelism: which rank receives how many routed rows depends on the data, so a rank's activations
# are within the tolerance (moe-dp2-ep2-zero1 2.9%, moe-dp2-cp2-ep2-zero1 3.8%: 552,320-596,096 counted
# against 574,208), while the mean over the ranks holding the same tokens (an ep group receives what it
# sends) is the prediction to the byte.
BALANCED = {2: ["moe-dp2-ep2-zero1"], 4: ["moe-dp2-cp2-ep2-zero1"]}
EP_TOLERANCE = 0.04  # their per-rank bound, also under PLANNER_MEMORY_TOLERANCE=0
# Muon under ZeRO-1/2: a rank's flat range is where the bucket's equal cut falls, so how many of its elements are
# hidden matrices (4 bytes of momentum) or the rest (8 of AdamW's moments) is the cut's (rank 0 73,728 bytes and
# rank 1 113,152 for muon-zero1, and their peaks with them); the prediction is their mean, to the byte
OPTIMIZER_MEAN = {2: ["muon-zero1"]}


@pytest.mark.parametrize("size", sorted(CASES))
def test_predicted_memory_matches_counted_bytes(worlds, tmp_path, size):
    cases = CASES[size]
    results = counted_bytes(worlds, size, str(tmp_path))
    for rank, counted in enumerate(results):
        for name, overrides in cases.items():
            cfg = make_config([*overrides, "train.steps=1"], str(tmp_path))
            bound = max(TOLERANCE, EP_TOLERANCE) if name in BALANCED.get(size, []) else TOLERANCE
            mean = name in OPTIMIZER_MEAN.get(size, [])
            _check(predict_memory(cfg, size, rank=rank), {k: v for k, v in counted[name].items()
                                                          if not (mean and k in ("optimizer", "peak"))}, f"{name} rank {rank}:", bound)
            assert counted[name]["activations"] > 0
    for name in OPTIMIZER_MEAN.get(size, []):
        cfg = make_config([*cases[name], "train.steps=1"], str(tmp_path))
        predicted = {predict_memory(cfg, size, rank=r)["optimizer"] for r in range(size)}
        assert predicted == {sum(counted[name]["optimizer"] for counted in results) / size}, (name, predicted)
    for name in BALANCED.get(size, []):
        cfg = make_config([*cases[name], "train.steps=1"], str(tmp_path))
        predicted = {predict_memory(cfg, size, rank=r)["activations"] for r in range(size)}
        total = sum(counted[name]["activations"] for counted in results)
        assert predicted == {total / size}, f"{name}: the ranks' mean {total / size} against {predicted}"


def cp_extra(m, method: str, cp: int, b: int, seq: int, c: int = 4) -> int:
    """Bytes one block saves at cp beyond 1/cp of what it saves at cp = 1 (b sequences of S = `seq` tokens,
    s = S/cp of each on the rank, a heads, g kv heads of size d, c bytes per element; the law's docstring)."""
    s, a, g, d, rope = seq // cp, m.heads, m.kv_heads, m.head_dim, m.position == "rope"
    if method == "ring":  # the core's fp32 output and the o projection's own input, for SDPA's output (+ RoPE's copy)
        return 4 * b * s * a * d + c * b * s * a * d - c * b * s * a * d * (2 if rope else 1)
    if method == "allgather":  # the other ranks' K and V; its fused blocks merged in fp32 as the ring's
        return c * b * (cp - 1) * s * 2 * g * d + 4 * b * s * a * d + c * b * s * a * d - c * b * s * a * d * (2 if rope else 1)
    return 0 if rope else c * b * s * a * d  # ulysses: SDPA's own output (is_causal: no mask)


def test_activations_per_rank_are_one_cp_th_of_cp1_plus_the_methods_extra(worlds, tmp_path):
    """The 1/cp law, on the counted bytes and on the planner's: at cp = 2 and 4 (same global batch and
    sequence, so the same b sequences of S tokens per micro-batch) every rank's activations are

        A(cp) = (A(1) - 8 b) / cp  +  L x E(method, cp)  +  (L - 1) x 4 s d   (the last with RoPE)

    with s = S/cp, L blocks, a heads, g kv heads of size d, c bytes per element (4: fp32 on the CPU):
    every item a block saves, the embedding's ids and positions and the head's logits, log-sum-exp and
    targets are per token, so 1/cp of cp = 1's; cp = 1's token rows are a view of the rank's rows of
    S + 1 tokens (8 b bytes not per token; under cp the split inputs are a copy of s tokens); cp = 1
    caches one pair of rotary tables (4 S d), each block under cp computes its own (4 s d); and per block
    the method's extra E (docs/planner.md "Context parallelism: the 1/cp law"):

        ring       4 b s a d  (the core merges its blocks in fp32 and saves its output)
                   - c b s a d with RoPE (the o projection's input is a copy of the core's output either way,
                   in place of SDPA's output and RoPE's copy); the blocks in flight are not saved
        allgather  c b (cp - 1) s 2 g d  (the other ranks' K and V, gathered)  +  the ring's terms (its fused
                   blocks over the gathered keys merged in fp32)
        ulysses    c b s a d without RoPE (SDPA's head-sharded output beside the o projection's input; SDPA
                   runs is_causal on whole sequences: no mask)
    """
    counted = {size: counted_bytes(worlds, size, str(tmp_path)) for size in (1, 2, 4)}
    checked = 0
    for prefix in ("", "llama-"):
        one_name = f"{prefix}cp1"
        cfg1 = make_config([*CASES[1][one_name], "train.steps=1"], str(tmp_path))
        m, b, seq = cfg1.model, cfg1.train.global_batch, cfg1.train.seq_len  # dp = 1, one micro-batch; fp32
        rope = m.position == "rope"
        one = {"counted": counted[1][0][one_name]["activations"],
               "predicted": predict_memory(cfg1, 1, rank=0)["activations"]}
        for cp in (2, 4):
            for method in CP_METHODS:
                name = f"{prefix}cp{cp}-{method}"
                if name not in CASES[cp]:
                    continue
                overrides = CASES[cp][name]
                assert not any(o.startswith("model.kv_heads") for o in overrides), name  # cp1's shapes
                tables = (m.layers - 1) * 4 * (seq // cp) * m.head_dim if rope else 0
                extra = m.layers * cp_extra(m, method, cp, b, seq) + tables
                cfg = make_config([*overrides, "train.steps=1"], str(tmp_path))
                for rank in range(cp):
                    figures = {"counted": counted[cp][rank][name]["activations"],
                               "predicted": predict_memory(cfg, cp, rank=rank)["activations"]}
                    for source, total in figures.items():
                        per_token = total - extra  # the sequence-proportional terms at cp
                        assert cp * per_token == one[source] - 8 * b, \
                            (f"{name} rank {rank} {source}: {total} = {per_token} per token + {extra} extra; "
                             f"cp=1: {one[source]} ({one[source] - 8 * b} per token), not {cp} x")
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("size", sorted(HF_CASES))
def test_predicted_activations_of_a_hugging_face_llama(worlds, size):
    pytest.importorskip("transformers")
    import transformers

    cases = HF_CASES[size]
    results = worlds(size).run(hf_saved_bytes, cases)
    for rank, measured in enumerate(results):
        for (changes, batch, seq, sp, dtype), counted in zip(cases, measured):
            m = hf_llama_model(transformers.LlamaConfig(**{**HF, **changes}))
            st = Strategy(tp=size, sequence_parallel=sp and size > 1, precision="fp32" if dtype == "float32" else "bf16")
            predicted = stage_memory(Workload(m, batch, seq, "hf-llama"), st, 0).activations
            err = abs(predicted / counted - 1)
            assert err <= HF_TOLERANCE, f"tp={size} {changes} {dtype} sp={sp} rank {rank}: {predicted} vs {counted}"
