import torch

from tests.helpers import rel_err

from threefold.config import load_config
from threefold.models.decoder import build_model, count_parameters, init_parameters
from threefold.models.presets import PRESETS, PUBLISHED_PARAMS


def model_cfg(*overrides):
    return load_config(None, list(overrides)).model


def test_published_parameter_counts():
    for preset, published in PUBLISHED_PARAMS.items():
        count = count_parameters(model_cfg(f"model.preset={preset}"))
        assert abs(count - published) / published < 0.01, (preset, count, published)
    assert count_parameters(model_cfg("model.preset=gpt2-124m")) == 124_439_808  # exact
    assert count_parameters(model_cfg("model.preset=llama-7b")) == 6_738_415_616  # exact


def test_init_depends_only_on_seed_and_name():
    cfg = model_cfg("model.preset=tiny-llama")
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # a part initialised alone gets the values it has in the whole model
    block = a.blocks[1]
    fresh = build_model(cfg, 0).blocks[1]
    params = dict(fresh.named_parameters(prefix="blocks.1"))
    init_parameters(torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([torch.nn.Identity(), fresh])}), 3, cfg)
    for name, p in block.named_parameters(prefix="blocks.1"):
        assert torch.equal(p, params[name]), name


def test_variants_run_and_learn_shapes():
    for preset in ("tiny", "tiny-llama"):
        cfg = model_cfg(f"model.preset={preset}")
        model = build_model(cfg, 0)
        tokens = torch.randint(0, cfg.vocab, (2, 16))
        logits = model(tokens)
        assert logits.shape == (2, 16, cfg.vocab)
        loss = model(tokens, tokens) / tokens.numel()
        assert abs(loss.item() - torch.log(torch.tensor(256.0))) < 0.5  # near uniform at init
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_causal_and_tied():
    cfg = model_cfg("model.preset=tiny")
    model = build_model(cfg, 0)
    assert model.head.weight is model.embed.tok.weight
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    assert torch.allclose(model(tokens)[0, :8], model(changed)[0, :8], atol=1e-6)  # no peeking ahead
    untied = build_model(model_cfg("model.preset=tiny-llama"), 0)
    assert untied.head.weight is not untied.embed.tok.weight
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "llama-7b", "llama-70b", "llama-405b", "gpt3-175b"}


def test_grouped_query_attention_through_sdpa_equals_expanded_heads():
    """SDPA's grouped heads (k, v never expanded) against attention written out with every kv head
    repeated for its group of q heads: softmax(q k^T / sqrt(d) + causal mask) v."""
    from threefold.models.decoder import Attention

    cfg = model_cfg("model.preset=tiny-llama")
    assert cfg.kv_heads < cfg.heads
    torch.manual_seed(0)
    attn = Attention(cfg)
    b, s, d = 2, 7, cfg.head_dim
    q, k, v = torch.randn(b, cfg.heads, s, d), torch.randn(b, cfg.kv_heads, s, d), torch.randn(b, cfg.kv_heads, s, d)
    group = cfg.heads // cfg.kv_heads
    k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k_all.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v_all
    got = attn.core(q, k, v)
    assert rel_err(got, expected) < 1e-6
