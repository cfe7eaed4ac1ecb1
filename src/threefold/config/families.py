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
