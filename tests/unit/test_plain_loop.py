"""bench/plain_loop.py, the plain reference loop, against Hugging Face's own models: GPT2LMHeadModel and
LlamaForCausalLM built from a config of the same shape, the plain model's weights (drawn at unit scale)
copied in, two steps of
the same AdamW (weight decay on matrices), clipping at 1.0: both losses equal to 1e-5 in fp32, and the
logits of the first forward too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def plain_loop():
    if "plain_loop" not in sys.modules:
        spec = importlib.util.spec_from_file_location("plain_loop", BENCH / "plain_loop.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["plain_loop"] = module
        spec.loader.exec_module(module)
    return sys.modules["plain_loop"]


def _hf_gpt2(s: dict, model) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=s["vocab"], n_positions=s["max_seq"], n_embd=s["hidden"], n_layer=s["layers"],
                     n_head=s["heads"], n_inner=s["ffn"], activation_function="gelu_new",
                     layer_norm_epsilon=s["norm_eps"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=True)
    hf = GPT2LMHeadModel(cfg)
    t = hf.transformer
    with torch.no_grad():
        t.wte.weight.copy_(model.embed.weight)
        t.wpe.weight.copy_(model.pos.weight)
        for block, mine in zip(t.h, model.blocks):
            for theirs, ours in [(block.ln_1, mine.norm1), (block.ln_2, mine.norm2)]:
                theirs.weight.copy_(ours.weight)
                theirs.bias.copy_(ours.bias)
            for theirs, ours in [(block.attn.c_attn, mine.attn.qkv), (block.attn.c_proj, mine.attn.proj),
                                 (block.mlp.c_fc, mine.up), (block.mlp.c_proj, mine.down)]:
                theirs.weight.copy_(ours.weight.t())  # Conv1D holds (in, out)
                theirs.bias.copy_(ours.bias)
        t.ln_f.weight.copy_(model.norm.weight)
        t.ln_f.bias.copy_(model.norm.bias)
    return hf


def _hf_llama(s: dict, model) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], rms_norm_eps=s["norm_eps"], rope_theta=s["rope_theta"],
                      max_position_embeddings=s["max_seq"], tie_word_embeddings=s["tie"], attention_bias=False,
                      mlp_bias=False)
    hf = LlamaForCausalLM(cfg)
    m, d, kv = hf.model, s["hidden"] // s["heads"], s["kv_heads"] * (s["hidden"] // s["heads"])
    with torch.no_grad():
        m.embed_tokens.weight.copy_(model.embed.weight)
        for layer, mine in zip(m.layers, model.blocks):
            layer.input_layernorm.weight.copy_(mine.norm1.weight)
            layer.post_attention_layernorm.weight.copy_(mine.norm2.weight)
            q, k, v = mine.attn.qkv.weight.split([s["heads"] * d, kv, kv])
            layer.self_attn.q_proj.weight.copy_(q)
            layer.self_attn.k_proj.weight.copy_(k)
            layer.self_attn.v_proj.weight.copy_(v)
            layer.self_attn.o_proj.weight.copy_(mine.attn.proj.weight)
            gate, up = mine.up.weight.chunk(2)
            layer.mlp.gate_proj.weight.copy_(gate)
            layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(mine.down.weight)
        m.norm.weight.copy_(model.norm.weight)
        if not s["tie"]:
            hf.lm_head.weight.copy_(model.head.weight)
    return hf


def _hf_step(hf, optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """The reference step: Hugging Face's own shifted loss, clip, AdamW."""
    loss = hf(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_the_plain_loop_is_hugging_faces_model_step_for_step(preset):
    pl = plain_loop()
    s = dict(pl.shape_of(preset), max_seq=16)
    torch.manual_seed(0)
    plain = pl.make_plain(s, torch.device("cpu"), compile=False)
    with torch.no_grad():  # weights of unit scale: the activations reach where GELU's and rotary's forms differ
        for p in plain.model.parameters():
            p.normal_(0.0, 0.25)
    hf = (_hf_llama if s["family"] == "llama" else _hf_gpt2)(s, plain.model)
    hf.config._attn_implementation = "sdpa"
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    groups = [dict(params=decay, weight_decay=pl.WEIGHT_DECAY),
              dict(params=[p for p in hf.parameters() if p.dim() < 2], weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups, lr=pl.LR, betas=pl.BETAS, foreach=True)
    tokens = torch.randint(0, s["vocab"], (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = plain.model(tokens), hf(input_ids=tokens).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    for _ in range(2):
        want = _hf_step(hf, optimizer, tokens)
        got = plain.step(tokens[:, :-1], tokens[:, 1:])
        assert got.device.type == "cpu" and got.shape == ()
        assert abs(got.item() - want.item()) / abs(want.item()) < 1e-5, (got.item(), want.item())
    assert plain.flops_per_token(12) == 6 * sum(p.numel() for p in plain.model.parameters()) + 12 * 2 * 32 * 12


def test_shape_of_reads_the_presets():
    pl = plain_loop()
    gpt2 = pl.shape_of("gpt2-124m")
    assert gpt2 == dict(family="gpt2", vocab=50304, hidden=768, layers=12, heads=12, kv_heads=12, ffn=3072, tie=True,
                        norm_eps=1e-5, rope_theta=10000.0, max_seq=1024)
    plain = pl.make_plain(dict(gpt2, layers=0), torch.device("meta"), compile=False)
    assert sum(p.numel() for p in plain.model.parameters()) == 50304 * 768 + 1024 * 768 + 2 * 768
    assert pl.shape_of("llama-7b")["family"] == "llama" and pl.shape_of("llama-1b")["kv_heads"] == 8
    with pytest.raises(KeyError, match="unknown preset 'gpt5'"):
        pl.shape_of("gpt5")
