"""The plain reference loop a GPU user would write, with none of threefold's model or loss code.

    from plain_loop import make_plain, shape_of
    plain = make_plain(shape_of("gpt2-124m"), torch.device("cuda"), compile=True)
    loss = plain.step(tokens, targets)          # a device tensor; nothing read back to the host

Two models, written here from their papers' and nanoGPT's shape:

* **gpt2** - learned positions, LayerNorm, a GELU (tanh) MLP, one fused qkv Linear,
  `F.scaled_dot_product_attention(is_causal=True)`, the head tied to the embedding (nanoGPT);
* **llama** - RMSNorm, rotary positions (rotate-half, as Hugging Face's Llama), a SwiGLU MLP, grouped
  query attention (`enable_gqa`: k and v are never expanded), one fused qkv Linear, SDPA is_causal.

The step is nanoGPT's: forward and `F.cross_entropy` inside the (compiled) model, backward,
`clip_grad_norm_(1.0)`, AdamW (lr 6e-4, betas 0.9 / 0.95, weight decay 0.1 on matrices only; fused on
CUDA, foreach elsewhere), `zero_grad(set_to_none=True)`. On CUDA the weights stay fp32 under
`torch.autocast(bfloat16)`; on CPU everything is fp32. `compile=True` compiles the whole model
(`torch.compile(model, backend=...)`), loss included. tests/unit/test_plain_loop.py holds the
loss and two steps equal to Hugging Face's GPT2LMHeadModel / LlamaForCausalLM with the same weights.

`shape_of(preset)` reads threefold.config.presets (plain data) into the shape these models take:
family, vocab (the embedding's rows: the preset's vocabulary padded to its `vocab_multiple`), hidden,
layers, heads, kv_heads, ffn, tie, norm_eps, rope_theta, max_seq; `llama-1b` is Llama 3.2 1B's shape.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

LR, BETAS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0
INIT_STD = 0.02
# Llama 3.2 1B (tied embeddings, 16 blocks of 2048, 32 heads over 8 key/value heads)
EXTRA_SHAPES = {"llama-1b": dict(family="llama", vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8,
                                 ffn=8192, tie=True, norm_eps=1e-5, rope_theta=500000.0, max_seq=2048)}


def shape_of(preset: str) -> dict:
    """The shape of threefold's preset `preset` (or of EXTRA_SHAPES) as plain data."""
    if preset in EXTRA_SHAPES:
        return dict(EXTRA_SHAPES[preset])
    from threefold.config.presets import PRESETS

    if preset not in PRESETS:
        raise KeyError(f"shape_of: unknown preset '{preset}' (known: {sorted(PRESETS) + sorted(EXTRA_SHAPES)})")
    p = PRESETS[preset]
    if p.get("experts", 0) or p.get("head_size", 0):
        raise KeyError(f"shape_of: '{preset}' is not a dense decoder of hidden / heads head size")
    multiple = p.get("vocab_multiple", 1)
    return dict(family="llama" if p["mlp"] == "swiglu" else "gpt2", vocab=-(-p["vocab"] // multiple) * multiple,
                hidden=p["hidden"], layers=p["layers"], heads=p["heads"], kv_heads=p["kv_heads"],
                ffn=p["ffn_hidden"], tie=p["tie_embeddings"], norm_eps=p.get("norm_eps", 1e-5),
                rope_theta=p.get("rope_theta", 10000.0), max_seq=p["max_seq"])


class Attention(nn.Module):
    """Fused qkv, SDPA is_causal (grouped heads by enable_gqa), an output projection."""

    def __init__(self, s: dict, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], s["hidden"] // s["heads"]
        self.qkv = nn.Linear(s["hidden"], (self.heads + 2 * self.kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(self.heads * self.head_dim, s["hidden"], bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def rope_tables(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, head_dim) of the rotate-half convention (each frequency twice)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        self.llama = s["family"] == "llama"
        bias = not self.llama
        norm = (lambda: RMSNorm(s["hidden"], s["norm_eps"])) if self.llama else \
            (lambda: nn.LayerNorm(s["hidden"], eps=s["norm_eps"]))
        self.norm1, self.attn, self.norm2 = norm(), Attention(s, bias), norm()
        self.up = nn.Linear(s["hidden"], (2 if self.llama else 1) * s["ffn"], bias=bias)  # gate and up, fused
        self.down = nn.Linear(s["ffn"], s["hidden"], bias=bias)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        h = self.up(self.norm2(x))
        if self.llama:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return x + self.down(h)


class Decoder(nn.Module):
    """GPT-2 or Llama; forward(tokens, targets) -> the mean cross-entropy, forward(tokens) -> logits."""

    def __init__(self, s: dict):
        super().__init__()
        self.shape, self.llama = dict(s), s["family"] == "llama"
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.pos = None if self.llama else nn.Embedding(s["max_seq"], s["hidden"])
        self.blocks = nn.ModuleList(Block(s) for _ in range(s["layers"]))
        self.norm = RMSNorm(s["hidden"], s["norm_eps"]) if self.llama else nn.LayerNorm(s["hidden"], eps=s["norm_eps"])
        self.head = nn.Linear(s["hidden"], s["vocab"], bias=False)
        if s["tie"]:
            self.head.weight = self.embed.weight
        if self.llama:
            cos, sin = rope_tables(s["max_seq"], s["hidden"] // s["heads"], s["rope_theta"], None)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, INIT_STD / math.sqrt(2 * s["layers"]))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, INIT_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, INIT_STD)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        rope = None
        if self.llama:
            rope = (self.cos[:t], self.sin[:t])
        else:
            x = x + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class PlainLoop:
    """The model, its (compiled) forward, fused AdamW; `step` is one training step on the device."""

    def __init__(self, shape: dict, device: torch.device, compile: bool, backend: str, fused: bool):
        self.device = torch.device(device)
        with self.device:  # built in place: no host copy of the weights, the tied head stays tied
            self.model = Decoder(shape)
        self.forward = torch.compile(self.model, backend=backend) if compile else self.model
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [dict(params=decay, weight_decay=WEIGHT_DECAY), dict(params=rest, weight_decay=0.0)]
        on_cuda = self.device.type == "cuda"
        kind = dict(fused=True) if fused and on_cuda else dict(foreach=True)
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **kind)
        self.dtype = torch.bfloat16 if on_cuda else torch.float32

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """forward, backward, clip to 1.0, AdamW, zero_grad(set_to_none=True): the loss, on the device."""
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.forward(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def flops_per_token(self, seq_len: int) -> float:
        """6 N + 12 L h s: every weight forward and backward, plus attention scores and values."""
        s = self.model.shape
        n = sum(p.numel() for p in self.model.parameters())
        return float(6 * n + 12 * s["layers"] * s["hidden"] * seq_len)


def make_plain(shape: dict, device, *, compile: bool, backend: str = "inductor", fused: bool = True) -> PlainLoop:
    """The plain loop of `shape` (shape_of's keys) on `device`; `compile` compiles the whole model."""
    return PlainLoop(shape, device, compile, backend, fused)
