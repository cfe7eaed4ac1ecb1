"""The reference decoder: one transformer with a GPT and a Llama variant.

Plain single-device PyTorch; nothing here knows about processes. Parallel strategies act on
it from outside through its plan (`models/decoder_plan.py`): module names are part of that contract.

    embed.tok, embed.pos          token and (learned) position embeddings
    blocks.<i>.attn_norm, .attn   pre-norm attention: q, k, v, o projections
    blocks.<i>.mlp_norm, .mlp     pre-norm MLP: up, down (GELU) or gate, up, down (SwiGLU)
    norm, head, loss              final norm, output projection, token cross-entropy (sum)
    mtp.<k>                       multi-token prediction depths (`model.mtp_depth` > 0; models/mtp.py):
                                  hidden_norm, embed_norm, proj, block (as blocks.<i>), norm

Modules read their sizes from their weights at run time (heads = q.out_features / head_dim),
so a tensor-parallel plan can shard the weights and the same forward runs on the shards.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .loss import TokenCrossEntropy, head_loss
from .meta import on_meta
from .moe import MoE
from .mtp import MTPDepth, mtp_loss

__all__ = ["AttentionCore", "CausalCore", "Decoder", "TokenCrossEntropy", "build_model", "causal_forward",
           "count_parameters", "init_parameters", "initial_value", "make_norm", "rotary_at"]


def make_norm(cfg: ModelConfig) -> nn.Module:
    """torch's own norms: `nn.RMSNorm` runs torch's fused kernel where one exists (CUDA) and its
    composite (fp32 statistics, normalised value rounded to the input dtype, then the gain, as
    Hugging Face's Llama does) elsewhere."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


_ROTARY_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotary_tables(seq: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, head_dim/2) (fp32) for rotary position embeddings.

    Computed once per (seq, head_dim, theta, device) and shared by every block and every forward
    (kept outside autograd and inference mode, so one table serves training and evaluation). While
    torch.compile traces, the tables are computed in the graph instead (nothing is cached)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (seq, head_dim, theta, device)
    tables = None if torch.compiler.is_compiling() else _ROTARY_CACHE.get(key)
    if tables is None:
        with torch.inference_mode(False), torch.no_grad():
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
            angles = torch.outer(torch.arange(seq, dtype=torch.float64, device=device), inv_freq)
            tables = angles.cos().float(), angles.sin().float()
        if device.type != "meta" and not torch.compiler.is_compiling():
            _ROTARY_CACHE[key] = tables
    return tables


def rotary_at(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (fp32) at explicit `positions`, (s,) -> (s, head_dim/2) or (b, s) -> (b, 1, s, head_dim/2):
    the rows of `rotary_tables` at those positions (the same float64 arithmetic, so bitwise equal)."""
    with torch.no_grad():
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
                                    / head_dim))
        angles = positions.to(torch.float64)[..., None] * inv_freq
        cos, sin = angles.cos().float(), angles.sin().float()
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def apply_rotary(x_bnsd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of each head by the position's angles."""
    x = x_bnsd.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x_bnsd.dtype)


class AttentionCore(Protocol):
    """What a block's attention computes once q, k, v are projected: the seam through which context
    parallelism (parallel/context.py `ContextCore`) replaces the attention and the positions."""

    def rotary_positions(self, seq: int, device) -> torch.Tensor | None:
        """The rotary positions of the `seq` local tokens, (s,) or (b, s); None: 0 .. seq-1."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output (b, heads, s, d) of q (b, heads, s, d), k and v (b, kv_heads, s, d)."""


class CausalCore:
    """The default core: causal softmax attention over the whole local sequence, positions 0 .. s-1.

    Grouped-query attention (fewer kv heads, each serving a group of q heads) goes to SDPA's
    grouped heads (`enable_gqa`): k and v are never expanded to every head."""

    def rotary_positions(self, seq: int, device) -> torch.Tensor | None:
        return None

    def __call__(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_core: AttentionCore = CausalCore()
        self.head_dim = cfg.head_dim
        self.rope = cfg.position == "rope"
        self.rope_theta = cfg.rope_theta
        kv = cfg.kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.attn_width, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, kv, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, kv, bias=cfg.bias)
        self.o = nn.Linear(cfg.attn_width, cfg.hidden, bias=cfg.bias)
        if self.k.bias is not None:
            # softmax(q.(k + b)) = softmax(q.k): the key bias gets an identically zero gradient.
            # It is kept (GPT-2 has it, so weights import and parameter counts match) but frozen:
            # training it would only turn rounding noise into Adam-sized steps.
            self.k.bias.requires_grad_(False)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_bsh.shape
        q = self.q(x_bsh).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # b, heads, s, d
        k = self.k(x_bsh).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # b, kv_heads, s, d
        v = self.v(x_bsh).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        if self.rope:
            positions = self.attention_core.rotary_positions(s, x_bsh.device)
            cos, sin = (rotary_tables(s, self.head_dim, self.rope_theta, x_bsh.device) if positions is None
                        else rotary_at(positions, self.head_dim, self.rope_theta))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v)
        return self.o(y.transpose(1, 2).flatten(2))

    def core(self, q, k, v):
        """The attention itself (`attention_core`, by default causal SDPA: `CausalCore`); a separate
        method so selective checkpointing can target it."""
        return self.attention_core(q, k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x_bsh):
        if self.swiglu:
            return self.down(F.silu(self.gate(x_bsh)) * self.up(x_bsh))
        return self.down(F.gelu(self.up(x_bsh), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm attention and MLP; the MLP is a mixture of experts (models/moe.py) in sparse blocks."""

    def __init__(self, cfg: ModelConfig, sparse: bool = False):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        if sparse:
            shared = (MLP(replace(cfg, ffn_hidden=cfg.shared_experts * cfg.expert_width))
                      if cfg.shared_experts else None)
            self.mlp = MoE(cfg, shared)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x_bsh):
        x_bsh = x_bsh + self.attn(self.attn_norm(x_bsh))
        return x_bsh + self.mlp(self.mlp_norm(x_bsh))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq, cfg.hidden) if cfg.position == "learned" else None
        # the learned positions' seam: the global positions of the local tokens (s,) when the sequence
        # is split (context parallelism sets them from outside); None: 0 .. s-1
        self.positions: torch.Tensor | None = None

    def forward(self, tokens_bs, positions: bool = True):
        """Token (and learned position) embeddings; `positions=False`: the token embedding alone (the
        multi-token prediction depths embed tokens for positions whose hidden state has them already)."""
        x = self.tok(tokens_bs)
        if self.pos is not None and positions:
            positions = (self.positions if self.positions is not None
                         else torch.arange(tokens_bs.shape[1], device=tokens_bs.device))
            x = x + self.pos(positions)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i)) for i in range(cfg.layers))
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)
        self.loss = TokenCrossEntropy(cfg.vocab if cfg.padded_vocab > cfg.vocab else None)
        if cfg.mtp_depth:  # DeepSeek-V3's extra depths (models/mtp.py); dense blocks, the shared embedding and head
            self.mtp = nn.ModuleList(MTPDepth(cfg.hidden, make_norm(cfg), make_norm(cfg), Block(cfg), make_norm(cfg))
                                     for _ in range(cfg.mtp_depth))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the output projection (again after `to_empty`)."""
        if self.cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def forward(self, tokens_bs, targets_bs=None):
        """Logits (b, s, vocab), or the summed token loss when `targets_bs` is given.

        The rows padding the vocabulary (`model.vocab_multiple`) are cut from whole logits; a
        tensor-parallel head's slice is left as it is (`parallel.tensor.gather_vocab` cuts them)."""
        out = causal_forward(self, tokens_bs, targets_bs, self.cfg.loss_chunk,
                             self.mtp if self.cfg.mtp_depth else None, self.cfg.mtp_weight)
        if targets_bs is None and out.shape[-1] == self.cfg.padded_vocab > self.cfg.vocab:
            return out[..., :self.cfg.vocab]
        return out


VOCAB_ROWS = ("embed.tok.weight", "head.weight")  # parameters with one row per token id (padded)


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed for one parameter, from the run seed and the parameter's name only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def initial_value(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The initial value of parameter `name` (whole, fp32): a function of (seed, name) only.

    Biases start at zero, norm gains at one, every other weight ~ N(0, init_std), residual
    output projections (attn.o, mlp.down and the experts' down projections) with
    std / sqrt(2 * layers) as in GPT-2.
    """
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    if name in VOCAB_ROWS and shape[0] > cfg.vocab:  # padded rows start at zero; the real ones as unpadded
        return torch.cat([initial_value(name, (cfg.vocab, *shape[1:]), seed, cfg), torch.zeros(shape[0] - cfg.vocab,
                                                                                               *shape[1:])])
    std = cfg.init_std
    if name.endswith(("attn.o.weight", "mlp.down.weight", "mlp.shared.down.weight", "mlp.experts.w_down")):
        std /= math.sqrt(2 * cfg.layers)
    gen = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, cfg: ModelConfig) -> None:
    """Deterministic initialisation that depends only on (seed, parameter name) (`initial_value`).

    Because no parameter's values depend on which others exist, a pipeline stage or a tensor
    shard initialised alone gets exactly the values the whole model would have.
    """
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, tuple(param.shape), seed, cfg))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Decoder:
    """The whole model, initialised from `seed`, on `device`."""
    with on_meta():
        model = Decoder(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    init_parameters(model, seed, cfg)
    return model


def count_parameters(cfg: ModelConfig, padded: bool = True) -> int:
    """Exact parameter count without allocating anything (tied weights counted once); `padded=False`
    counts the real vocabulary's rows only (what the papers count), not those of `model.vocab_multiple`."""
    with on_meta():
        model = Decoder(cfg)
    total = sum(p.numel() for p in model.parameters())
    if not padded:
        total -= (cfg.padded_vocab - cfg.vocab) * cfg.hidden * (1 if cfg.tie_embeddings else 2)
    return total


def causal_forward(model: nn.Module, tokens_bs, targets_bs=None, loss_chunk: int = 0,
                   mtp: nn.ModuleList | None = None, mtp_weight: float = 0.0):
    """The forward every causal family shares: embed, blocks, final norm, head; logits (b, s, vocab),
    or the summed token loss when `targets_bs` is given (head and loss in pieces of `loss_chunk`
    tokens: models/loss.py), plus the multi-token prediction depths' weighted losses (`mtp`, models/mtp.py:
    training forwards only)."""
    x = model.embed(tokens_bs)
    for block in model.blocks:
        x = block(x)
    if targets_bs is None:
        return model.head(model.norm(x))
    loss = head_loss(model.head, model.loss, model.norm(x), targets_bs, loss_chunk)
    for block in model.blocks:  # the routers' auxiliary losses (models/moe.py), summed as token losses are
        if isinstance(block, Block) and isinstance(block.mlp, MoE):
            loss = loss + block.mlp.aux_sum
    extra = mtp_loss(mtp, model.embed, model.head, model.loss, x, targets_bs, mtp_weight, loss_chunk) if mtp else None
    return loss if extra is None else loss + extra
