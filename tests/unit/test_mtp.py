"""Multi-token prediction (models/mtp.py) against a plain PyTorch decoder with DeepSeek-V3's MTP
depths written out here (functional, on the parameters by name; depth k runs on the row cut
to its s - k positions rather than on padded targets), and the depth targets of packed rows.

`plain_loss` is the reference tests/distributed/test_mtp.py trains with."""

import math

import pytest
import torch
import torch.nn.functional as F

from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.models.cross_entropy import IGNORE_INDEX
from threefold.models.decoder import build_model
from threefold.models.mtp import depth_targets, mtp_figures, mtp_tally

LLAMA = ["model.preset=tiny-llama", "model.mtp_depth=2", "model.mtp_weight=0.5"]


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, theta):
    """Rotary embedding of (b, heads, s, d) on the pairs (x[2i], x[2i+1]), positions 0 .. s-1."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().float(), ang.sin().float()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


def attention(p, pre, x, m):
    """Pre-norm causal grouped-query attention with rotary positions, softmax written out (the residual added)."""
    b, s, _ = x.shape
    h = rms(x, p[pre + "attn_norm.weight"], m.norm_eps)
    q = (h @ p[pre + "attn.q.weight"].T).view(b, s, m.heads, -1).transpose(1, 2)
    k = (h @ p[pre + "attn.k.weight"].T).view(b, s, m.kv_heads, -1).transpose(1, 2)
    v = (h @ p[pre + "attn.v.weight"].T).view(b, s, m.kv_heads, -1).transpose(1, 2)
    q, k = rotate(q, m.rope_theta), rotate(k, m.rope_theta)
    k, v = k.repeat_interleave(m.heads // m.kv_heads, 1), v.repeat_interleave(m.heads // m.kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    return x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1) @ p[pre + "attn.o.weight"].T


def block(p, pre, x, m):
    """One Llama block (rmsnorm, rope, grouped-query attention, SwiGLU), softmax written out."""
    x = attention(p, pre, x, m)
    h = rms(x, p[pre + "mlp_norm.weight"], m.norm_eps)
    return x + (F.silu(h @ p[pre + "mlp.gate.weight"].T) * (h @ p[pre + "mlp.up.weight"].T)) @ p[pre + "mlp.down.weight"].T


def plain_loss(p: dict, rows: torch.Tensor, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(main summed cross-entropy, mtp_weight / D * sum_k CE_k summed) of token rows (b, s + 1)."""
    head = p.get("head.weight", p["embed.tok.weight"])
    s = rows.shape[1] - 1
    x = p["embed.tok.weight"][rows[:, :s]]
    for i in range(m.layers):
        x = block(p, f"blocks.{i}.", x, m)
    logits = rms(x, p["norm.weight"], m.norm_eps) @ head.T
    main = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    extra, h = 0.0, x
    for k in range(1, m.mtp_depth + 1):
        n, pre = s - k, f"mtp.{k - 1}."
        if n <= 0:  # a row (a document) too short for depth k: no target
            break
        e = p["embed.tok.weight"][rows[:, k:k + n]]  # t_{i+k}
        joined = torch.cat([rms(h[:, :n], p[pre + "hidden_norm.weight"], m.norm_eps),
                            rms(e, p[pre + "embed_norm.weight"], m.norm_eps)], -1)
        h = block(p, pre + "block.", joined @ p[pre + "proj.weight"].T, m)
        logits = rms(h, p[pre + "norm.weight"], m.norm_eps) @ head.T
        extra = extra + F.cross_entropy(logits.flatten(0, 1), rows[:, k + 1:k + 1 + n].flatten(), reduction="sum")
    return main, m.mtp_weight / m.mtp_depth * extra


def test_decoder_loss_and_gradients_match_the_plain_depths():
    m = load_config(None, LLAMA).model
    model = build_model(m, seed=3)
    rows = torch.randint(0, m.vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    loss = model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    p = {n: q.detach().clone().requires_grad_() for n, q in model.named_parameters()}
    main, extra = plain_loss(p, rows, m)
    (main + extra).backward()
    assert float(extra.detach()) > 0.1 * float(main.detach())  # the depths count
    total = float((main + extra).detach())
    assert abs(float(loss.detach()) - total) <= 1e-5 * total
    for name, q in model.named_parameters():
        err = float((q.grad - p[name].grad).norm() / p[name].grad.norm())
        assert err <= 1e-5, (name, err)
    table = mtp_tally(model, "cpu")  # one forward's figures, then nothing until the next
    assert torch.allclose(mtp_figures(table, 24)["mtp_loss"] * torch.ones(()), extra.detach() / 24)
    assert mtp_tally(model, "cpu").abs().sum() == 0 and table[:, 2].tolist() == [22, 20]


def test_depths_do_not_run_without_targets_or_gradients():
    m = load_config(None, LLAMA).model
    model = build_model(m, seed=3)
    plain = build_model(load_config(None, ["model.preset=tiny-llama"]).model, seed=3)
    rows = torch.randint(0, m.vocab, (2, 9))
    assert torch.equal(model(rows), plain(rows))  # logits: the main model's
    with torch.no_grad():  # evaluation: the main loss alone
        assert torch.equal(model(rows[:, :-1], rows[:, 1:]), plain(rows[:, :-1], rows[:, 1:]))


def test_depth_targets_stop_at_the_row_end_and_at_document_boundaries():
    no = IGNORE_INDEX
    # two documents [5 6 7] [8 9], then padding: the main targets of the last token of a document and of padding
    # do not count (train/step.py)
    targets = torch.tensor([[6, 7, no, 9, no, no]])
    (e1, t1), (e2, t2) = depth_targets(targets, 2)
    assert e1.tolist() == [[6, 7, 0, 9, 0, 0]] and t1.tolist() == [[7, no, no, no, no, no]]
    assert e2.tolist() == [[7, 0, 9, 0, 0, 0]] and t2.tolist() == [[no, no, no, no, no, no]]
    plain = torch.tensor([[1, 2, 3, 4]])
    (e1, t1), (e2, t2) = depth_targets(plain, 2)
    assert t1.tolist() == [[2, 3, 4, no]] and t2.tolist() == [[3, 4, no, no]] and e2.tolist() == [[2, 3, 4, 0]]


@pytest.mark.parametrize("extra,needle", [
    (["parallel.pp=2", "model.layers=4", "pipeline.schedule=pipedream-2bw", "train.microbatches=2"], "pipedream-2bw"),
    (["parallel.cp=2"], "context parallelism"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "sequence_parallel"),
    (["train.seq_len=2"], "no target"),
    (["model.preset=py:tests.unit.test_mtp:nothing"], "user's own module"),
])
def test_refusals_name_the_key(extra, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_config(None, LLAMA + extra).validate(2)
    assert info.value.field == "model.mtp_depth"


def test_pipeline_parallelism_is_taken():
    """The depths run on the last stage (pipeline/adapter.py `MTPAdapter`): every synchronous schedule."""
    for schedule in ("1f1b", "interleaved", "dualpipev"):
        load_config(None, LLAMA + ["parallel.pp=2", "model.layers=4", "train.microbatches=4",
                                   f"pipeline.schedule={schedule}"]).validate(2)


def test_a_weight_without_depths_is_refused():
    with pytest.raises(ConfigError, match="model.mtp_depth=0 turns off") as info:
        load_config(None, ["model.mtp_weight=0.1"]).validate(1)
    assert info.value.field == "model.mtp_weight"
    load_config(None, ["model.mtp_depth=0"]).validate(1)


def test_depth_losses_in_pieces_equal_the_whole_loss():
    """`model.loss_chunk`: each depth's head and loss in checkpointed pieces of its s - k positions."""
    rows = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for chunk in (0, 5):
        model = build_model(load_config(None, LLAMA + [f"model.loss_chunk={chunk}"]).model, seed=3)
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: q.grad for n, q in model.named_parameters()})
    assert abs(losses[0] - losses[1]) <= 1e-6 * losses[0]
    assert max(float((grads[1][n] - g).norm() / g.norm()) for n, g in grads[0].items()) <= 1e-5
