import torch

from tests.helpers import rel_err

from threefold.config import load_config
from threefold.models.decoder import build_model, count_parameters, init_parameters
from threefold.config.presets import PRESETS, PUBLISHED_PARAMS


def model_cfg(*overrides):
    return load_config(None, list(overrides)).model


def test_published_parameter_counts():
    for preset, published in PUBLISHED_PARAMS.items():
        count = count_parameters(model_cfg(f"model.preset={preset}"), padded=False)
        assert abs(count - published) / published < 0.01, (preset, count, published)
    assert count_parameters(model_cfg("model.preset=gpt2-124m"), padded=False) == 124_439_808  # exact
    assert count_parameters(model_cfg("model.preset=gpt2-124m")) == 124_439_808 + 47 * 768  # 50304 rows
    assert count_parameters(model_cfg("model.preset=llama-7b"), padded=False) == 6_738_415_616  # exact


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


def test_loss_in_pieces_equals_cross_entropy_on_the_whole_logits():
    """models/loss.py against F.cross_entropy on all logits at once (x @ W^T, fp32): the loss and
    the gradients of the head's input and weight within 1e-6, for pieces along the sequence and
    along rows; autograd keeps nothing of vocabulary size and the allocation peak is lower."""
    import torch.nn.functional as F
    from threefold.models.loss import TokenCrossEntropy, head_loss, piece_tokens, pieces
    from threefold.observe.memory import SavedTensorMeter, allocation_peak

    torch.manual_seed(0)
    b, s, h, vocab = 4, 48, 16, 2048
    head = torch.nn.Linear(h, vocab, bias=False)
    x0, targets = torch.randn(b, s, h), torch.randint(0, vocab, (b, s))

    def run(chunk):
        x = x0.clone().requires_grad_()
        head.weight.grad = None
        meter = SavedTensorMeter(exclude=[head.weight])
        out = {}

        def step():
            with meter.measure():
                out["loss"] = (head_loss(head, TokenCrossEntropy(), x, targets, chunk) if chunk is not None else
                               F.cross_entropy((x @ head.weight.T).flatten(0, 1).float(), targets.flatten(),
                                               reduction="sum"))
            out["loss"].backward()

        peak = allocation_peak(step)
        loss = out["loss"]
        return loss.detach(), x.grad, head.weight.grad.clone(), meter.peak, peak

    ref_loss, ref_dx, ref_dw, ref_saved, ref_peak = run(None)
    assert ref_saved >= 4 * b * s * vocab
    for chunk, shape in [(24, (b, 6)), (48, (1, s))]:  # along the sequence, then whole rows
        assert [xs.shape[:2] for xs, _ in pieces(x0, targets, chunk)] == [shape] * (b * s // (shape[0] * shape[1]))
        assert piece_tokens(b, s, chunk) == shape[0] * shape[1]
        loss, dx, dw, saved, peak = run(chunk)
        assert rel_err(loss, ref_loss) < 1e-6 and rel_err(dx, ref_dx) < 1e-6 and rel_err(dw, ref_dw) < 1e-6, chunk
        assert saved < 4 * b * s * h + 8 * b * s + 64, (chunk, saved)  # x and the targets (views), no logits
        assert peak < ref_peak / 2, (chunk, peak, ref_peak)
    whole, *_ = run(0)
    assert torch.equal(whole, ref_loss) or rel_err(whole, ref_loss) < 1e-6


def test_rms_norm_and_cached_rotary_tables():
    """nn.RMSNorm against the formula written out (fp32); the rotary tables are computed once per
    (seq, head size, theta, device), are the formula's, and serve autograd after inference mode."""
    from threefold.models.decoder import apply_rotary, make_norm, rotary_tables

    cfg = model_cfg("model.preset=tiny-llama")
    norm = make_norm(cfg)
    assert isinstance(norm, torch.nn.RMSNorm)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, cfg.hidden)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * norm.weight
    assert rel_err(norm(x).detach(), expected.detach()) < 1e-6

    s, d, theta = 11, cfg.head_dim, 1234.0
    with torch.inference_mode():
        cos, sin = rotary_tables(s, d, theta)
    assert rotary_tables(s, d, theta)[0] is cos and rotary_tables(s, d, theta, "cpu")[1] is sin  # cached
    angles = torch.arange(s, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    q = torch.randn(2, 4, s, d, requires_grad=True)
    apply_rotary(q, cos, sin).sum().backward()  # tables made under inference mode still serve autograd
    assert q.grad is not None
