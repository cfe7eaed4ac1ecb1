"""Tensor plans for Hugging Face `transformers` decoders: models threefold did not write.

The same styles as the reference decoder's plan, pointed at another library's module names.
Nothing here imports `transformers`: a plan is built from the model's config object alone.

Llama (`LlamaForCausalLM`): q/k/v/o and gate/up/down exactly like the reference decoder;
attention and MLP are the two regions of a layer. Its attention reshapes by `head_dim`, so the
local head counts follow from the sharded weights, except `num_key_value_groups`, which the
plan sets when key/value heads are replicated. The output head is split over the vocabulary
and gathered (`gather_output`), because the library computes its own loss from whole logits;
threefold's own decoder uses the vocabulary-parallel loss instead.

Sequence parallelism: the library reads positions and the causal mask off the embedding's
output, so the embedding keeps its whole sequence (all-reduce) and the sequence is cut at the
input of the first layer; from there on the norms run on sequence chunks, attention and MLP
all-gather their input and reduce-scatter their output, exactly like the reference decoder.

GPT-2 is not covered: its fused `c_attn` (q, k and v in one Conv1D) would give each rank three
separate column blocks of one parameter, which a single Placement box cannot describe.
"""

from __future__ import annotations

from .plans import ColumnParallel, GroupedKV, RowParallel, TensorPlan, VocabEmbedding, VocabHead


def llama_layers(config, tp: int, layer: str, where: str = "") -> tuple[dict, dict]:
    """The tensor plan of the decoder layers `layer` (a pattern such as "model.layers.*") of a
    Llama-shaped `transformers` config, and the attributes they need: (layers, attributes).
    `where` names the file in error messages (" in config.json")."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # a transformers config: not all families set it
    what_heads = f"attention heads (num_attention_heads={heads}{where})"
    what_ffn = f"MLP features (intermediate_size={config.intermediate_size}{where})"
    attributes = {}
    if kv_heads % tp and heads % tp == 0 and tp % kv_heads == 0:
        # each rank keeps one replicated kv head for its heads/tp query heads
        attributes[f"{layer}.self_attn"] = {"num_key_value_groups": heads // tp}
    layers = {
        f"{layer}.self_attn.q_proj": ColumnParallel(unit=head_dim, what=what_heads),
        f"{layer}.self_attn.k_proj": GroupedKV(heads, kv_heads, head_dim),
        f"{layer}.self_attn.v_proj": GroupedKV(heads, kv_heads, head_dim),
        f"{layer}.self_attn.o_proj": RowParallel(unit=head_dim, what=what_heads),
        f"{layer}.mlp.gate_proj": ColumnParallel(what=what_ffn),
        f"{layer}.mlp.up_proj": ColumnParallel(what=what_ffn),
        f"{layer}.mlp.down_proj": RowParallel(what=what_ffn),
    }
    return layers, attributes


def llama_plan(config, tp: int) -> TensorPlan:
    """The plan of a `transformers` LlamaForCausalLM with `config`, for `tp` ranks."""
    layer = "model.layers.*"
    layers, attributes = llama_layers(config, tp, layer)
    return TensorPlan(
        layers={"model.embed_tokens": VocabEmbedding(config.vocab_size, sequence_output=False), **layers,
                "lm_head": VocabHead(config.vocab_size, gather_output=True)},
        regions=(f"{layer}.self_attn", f"{layer}.mlp", "lm_head"),
        sequence=(f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm", "model.norm"),
        scatter_inputs={"model.layers.0": 1},
        attributes=attributes,
    )
