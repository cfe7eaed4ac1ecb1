"""The model families of `hf:DIR`: config.json's architecture -> the module that builds its spec.

Plain data, no torch: the config reads it (config/hf.py: which architectures and model types a
directory may name, which of them have experts) and so does the dispatch that builds a spec
(models/registry.py `SPEC_MODULES`, which imports the module only then). Adding a family is one
`Family` here; a new module is also one entry there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    architecture: str  # config.json's `architectures[0]` (the transformers class)
    model_type: str  # config.json's `model_type` (which picks the library's config class)
    module: str  # the module under threefold.models whose spec function builds it (registry.SPEC_MODULES)
    experts: bool = False  # a mixture of experts: its config.json sets the `model.*` expert keys


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", "hf_causal"),
    Family("MistralForCausalLM", "mistral", "hf_causal"),
    Family("Qwen2ForCausalLM", "qwen2", "hf_causal"),
    Family("Qwen3ForCausalLM", "qwen3", "hf_causal"),
    Family("GPT2LMHeadModel", "gpt2", "hf_gpt2"),
    Family("MixtralForCausalLM", "mixtral", "hf_moe", experts=True),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", "hf_moe", experts=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "hf_moe", experts=True),
)}


def sliding_window(raw: dict) -> int | None:
    """The sliding window of config.json's windowed layers (None: every layer full causal), as the library
    decides it (models/hf_causal.py `attention_windows`): Qwen's only with use_sliding_window - Qwen2/Qwen3
    from max_window_layers on, Qwen2-MoE in the even layers below max_window_layers, unless layer_types
    says which; Qwen3-MoE's in every layer -; Mistral's and Mixtral's in every layer; GPT-2 has none."""
    kind = raw.get("model_type")
    window = raw.get("sliding_window") or None
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if window is None or kind == "llama":
        return None
    if kind == "qwen3_moe":  # its attention takes config.sliding_window in every layer
        return window
    if types is not None:
        return window if "sliding_attention" in types else None
    if kind in ("qwen2", "qwen3"):
        return window if raw.get("max_window_layers", 28) < raw.get("num_hidden_layers", 0) else None
    if kind == "qwen2_moe":  # layer 0 is windowed when any is
        return window if raw.get("max_window_layers", 28) > 0 and raw.get("num_hidden_layers", 0) > 0 else None
    return window
