"""A model threefold did not write: a Hugging Face `transformers` Llama split by its own plan.

Built from a config with random weights (nothing downloaded), grouped-query attention with two
key/value heads (split at tp = 2, replicated at tp = 4) and a vocabulary of 250 (padded at tp = 4),
with and without sequence parallelism.
"""

import pytest

from tests.helpers import rel_err

pytest.importorskip("transformers")


def hf_llama_parity(sequence_parallel: bool) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.models.hf_plans import llama_plan
    from threefold.parallel.tensor import gather_full
    from threefold.parallel.tensor_plan import parallelize_tensor

    tp = dist.get_world_size()
    config = transformers.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)  # the same random weights on every rank
    reference = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(reference)
    mesh = Mesh(Layout(tp=tp), torch.device("cpu"))
    comm = Comm(mesh)
    placements = parallelize_tensor(model, mesh, comm, llama_plan(config, tp), sequence_parallel)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_out = reference(input_ids=tokens, labels=tokens)
    ref_out.loss.backward()
    comm.traffic.take_window()
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    sent = comm.traffic.take_window()["tp"]
    grads = gather_full({n: p.grad for n, p in model.named_parameters()}, placements, comm)
    errors = {"loss": rel_err(out.loss.detach(), ref_out.loss.detach()),
              "logits": rel_err(out.logits.detach(), ref_out.logits.detach())}
    errors.update({f"grad {n}": rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    local_q = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    return {"errors": errors, "sent": sent, "local_q_rows": local_q,
            "split": sorted(n for n, pl in placements.items() if "tp" not in pl.replicated_over)}


@pytest.mark.parametrize("size,sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_hf_llama_matches_single_process(worlds, size, sequence_parallel):
    for rank, r in enumerate(worlds(size).run(hf_llama_parity, sequence_parallel)):
        worst = max((e, k) for k, e in r["errors"].items())
        assert worst[0] <= 1e-5, f"rank {rank}: {worst[1]} differs by {worst[0]:.2e}"
        assert len(r["errors"]) == 2 + 2 * 9 + 3  # loss, logits, 9 tensors per layer, embed/norm/head
        assert r["local_q_rows"] == 32 // size  # the attention really is split
        assert "model.embed_tokens.weight" in r["split"] and "lm_head.weight" in r["split"]
        if sequence_parallel:  # per layer: 2 all-gathers + 2 reduce-scatters forward, mirrored backward
            assert r["sent"]["all_gather"] > 0 and r["sent"]["reduce_scatter"] > 0
        else:
            assert r["sent"]["all_reduce"] > 0 and "reduce_scatter" not in r["sent"]
