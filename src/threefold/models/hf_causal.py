"""Hugging Face decoders of the Llama shape: Llama (2/3 and look-alikes), Mistral, Qwen2, Qwen3
(and the entry point for GPT-2, models/hf_gpt2.py, and for the mixtures of experts Mixtral and
Qwen-MoE, models/hf_moe.py).

The modules are the `transformers` classes themselves - the decoder layers, norms, embedding
and head of `<Family>ForCausalLM`, built from the model directory's config.json - arranged in
the shape every threefold family has (models/spec.py):

    embed              model.embed_tokens
    blocks.<i>.layer   model.layers.<i>  (`HFBlock` adds the rotary position embeddings)
    norm, head         model.norm, lm_head (tied to the embedding when the config says so)
    loss               summed token cross-entropy (threefold's; vocabulary-parallel under tp)

so one pipeline adapter, one set of strategies and one checkpoint format serve them; the
Hugging Face checkpoint names are a rename of prefixes (`HF_RENAMES`). Attention is the
library's SDPA path: causal without a mask, or, in a layer the config gives a sliding window
(Mistral and Mixtral `sliding_window`: every layer; Qwen2/Qwen3 `use_sliding_window` with
`max_window_layers`, read through the config's `layer_types`), a banded causal boolean mask
(query i sees keys i - window < j <= i, as the library's own mask) built per block for the
whole sequence, so it holds under tensor and sequence parallelism, pipeline stages and
recomputation alike. The key-projection bias (Qwen2) is frozen, its gradient being identically
zero.

The attention seam (models/hf_attention.py): the library's attention modules call threefold's
attention function (`config._attn_implementation = ATTENTION`), which is the library's SDPA path
above unless the block has an `attention_core`; context parallelism and packed rows
(parallel/context.py `_wire`) give every `HFBlock` one, whose positions the block feeds to the
rotary embedding (the global zigzag ones; per document when packed) and which computes the
attention over the cp ranks at the module's `scaling`. The mixtures of experts (models/hf_moe.py)
have the same blocks, GPT-2 its own (models/hf_gpt2.py); a sliding window narrower than the sequence
is refused (config/checks.py).

Tensor plan: exactly the reference decoder's - q by heads, k/v by key/value heads (or
replicated when there are fewer than tp), o row-parallel, gate/up column, down row, the
vocabulary split for the embedding, the head and the loss. Qwen3's per-head q/k norms are
replicated and see only this rank's heads: their gradients are summed over tp (`partial`).
Under sequence parallelism the blocks see a sequence chunk: `seq_parts` tells them the whole
length for the rotary table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..config.hf import DROPOUT, read_config_json
from .plans import TensorPlan, VocabEmbedding, VocabHead, VocabLoss
from .decoder import TokenCrossEntropy, causal_forward
from .hf_plans import llama_layers
from .hf_attention import ATTENTION, HFAttentionCore, register as register_attention
from .spec import CausalAdapter, ContextSeams, HFFormat, ModelSpec, seeded_normal

HF_RENAMES = ((r"^embed\.", "model.embed_tokens."), (r"^blocks\.(\d+)\.layer\.", r"model.layers.\1."),
              (r"^norm\.", "model.norm."), (r"^head\.", "lm_head."))


def load_hf_config(directory: Path):
    """The `transformers` config object of the directory (nothing downloaded: a local path)."""
    raw = read_config_json(directory)
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(directory))
    config.architectures = raw["architectures"]  # checked against model_type, or taken from it
    config._attn_implementation = "sdpa"  # causal without a mask; eager would need one
    for key in DROPOUT:  # trained without dropout (config/hf.py DROPOUT); the export says so
        if key in config.to_dict():
            setattr(config, key, 0.0)
    return config


def trained_config(directory: Path) -> dict:
    """config.json as it was trained: its dropout at 0 (what `ckpt export --hf` writes)."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    return {**raw, **{key: 0.0 for key in DROPOUT if key in raw}}


def attention_windows(config) -> list[int | None]:
    """Per layer, the sliding window of its attention (None: full causal), as the library decides it."""
    raw = config.to_dict()
    window = raw.get("sliding_window") or None
    types = raw.get("layer_types")
    if types is None:  # Mistral, Mixtral: one window for every layer (or none)
        return [window] * raw["num_hidden_layers"]
    return [window if kind == "sliding_attention" else None for kind in types]


class HFBlock(nn.Module):
    """One library decoder layer, given the rotary position embeddings of the whole sequence (and its
    sliding window, when it has one narrower than the sequence: `attention_window`, no mask). `attention_core` is the attention seam
    (models/hf_attention.py): context parallelism and packed rows set one (parallel/context.py
    `ContextCore`), which gives the rotary positions and replaces the library's attention."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, window: int | None = None):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.window = window
        self.seq_parts = 1  # sequence parallelism: the input is one of seq_parts chunks of the sequence
        self.attention_core: HFAttentionCore | None = None  # None: the library's SDPA path, positions 0 .. s-1

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        s = x_bsh.shape[1] * self.seq_parts
        core = self.attention_core
        if core is None:
            positions = torch.arange(s, device=x_bsh.device).unsqueeze(0)
            window = self.window if self.window is not None and s > self.window else None
            return self.layer(x_bsh, position_embeddings=self.rotary(x_bsh, positions), position_ids=positions,
                              attention_window=window)
        local = core.rotary_positions(s, x_bsh.device)  # the global (or per-document) positions, (s,) or (b, s)
        positions = torch.arange(s, device=x_bsh.device) if local is None else local.to(x_bsh.device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        return self.layer(x_bsh, position_embeddings=self.rotary(x_bsh, positions), position_ids=positions,
                          attention_core=core)


class HFCausalLM(nn.Module):
    """A library causal LM's parts in threefold's shape: embed -> blocks -> norm -> head -> loss."""

    def __init__(self, config):
        super().__init__()
        import transformers

        register_attention()  # the library's attention modules call threefold's seam (models/hf_attention.py),
        config._attn_implementation = ATTENTION  # which is the library's SDPA path unless a block has a core
        library = transformers.AutoModelForCausalLM.from_config(config)
        with torch.device("cpu"):  # the rotary table is computed, not loaded: real values even under meta
            rotary_cls = type(library.model.rotary_emb)
            self.embed = library.model.embed_tokens
            self.blocks = nn.ModuleList(HFBlock(layer, rotary_cls(config=config), window)
                                        for layer, window in zip(library.model.layers, attention_windows(config)))
        self.norm = library.model.norm
        self.head = library.lm_head
        self.loss = TokenCrossEntropy()
        if config.tie_word_embeddings:
            self.head.weight = self.embed.weight
        for block in self.blocks:
            bias = block.layer.self_attn.k_proj.bias
            if bias is not None:
                # softmax(q.(k + b)) = softmax(q.k): an identically zero gradient, which training would
                # only turn into Adam-sized steps of rounding noise (as the reference decoder's key bias)
                bias.requires_grad_(False)

    def forward(self, tokens_bs, targets_bs=None):
        """Logits (b, s, vocab), or the summed token loss when `targets_bs` is given."""
        return causal_forward(self, tokens_bs, targets_bs)


def hf_plan(config, tp: int, dense_mlps: tuple[str, ...] | list[str] = ("*",)) -> TensorPlan:
    """The tensor plan; `dense_mlps` are the layers whose MLP is dense (a mixture of experts,
    models/hf_moe.py, keeps its sparse MLPs whole on every tp rank)."""
    layer = "blocks.*.layer"
    layers, attributes = llama_layers(config, tp, layer, " in config.json")
    mlp = {name.rpartition(".mlp.")[2]: style for name, style in layers.items() if ".mlp." in name}
    layers = {name: style for name, style in layers.items() if ".mlp." not in name}
    for i in dense_mlps:
        layers.update({f"blocks.{i}.layer.mlp.{proj}": style for proj, style in mlp.items()})
    qk_norms = (f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm")
    return TensorPlan(
        layers={"embed": VocabEmbedding(config.vocab_size), **layers,
                "head": VocabHead(config.vocab_size), "loss": VocabLoss(config.vocab_size)},
        regions=(f"{layer}.self_attn", *(f"blocks.{i}.layer.mlp" for i in dense_mlps), "head"),
        sequence=(f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "norm"),
        partial=qk_norms if config.model_type in ("qwen3", "qwen3_moe") else (),
        attributes=attributes,
        sequence_attributes={"blocks.*": {"seq_parts": tp}},
    )


def hf_init(config, seed: int):
    """Seeded initial values in the library's scheme: N(0, initializer_range), zero biases, unit norms."""
    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(shape)
        if "norm" in name:
            return torch.ones(shape)
        return seeded_normal(seed, name, shape, config.initializer_range)
    return init


def causal_spec(directory: Path, config, seed: int) -> ModelSpec:
    """A dense Llama-style family (models/registry.py picks the module by architecture)."""
    tied = {"head.weight": "embed.weight"} if config.tie_word_embeddings else {}
    return ModelSpec(
        family=config.architectures[0],
        build=lambda: HFCausalLM(config),
        plan=lambda tp: hf_plan(config, tp),
        adapter=CausalAdapter(tied),
        init=hf_init(config, seed),
        tied=tied,
        hf=HFFormat(HF_RENAMES, trained_config(directory), Path(directory)),
        selective=("layer.self_attn",),  # the library computes attention inside its attention module
        context=ContextSeams(attention=(HFBlock,)),
    )
