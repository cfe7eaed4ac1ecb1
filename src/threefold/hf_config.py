"""A Hugging Face model directory's config.json, read as threefold's `model.*` fields.

Plain JSON, no torch and no `transformers`: the config (validation, `threefold plan --model
hf:DIR`, the data pipeline's vocabulary) learns a directory's sizes from here, and the model
families (models/hf_causal.py, models/hf_gpt2.py) check the directory with the same reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel")


def read_config_json(directory: Path) -> dict:
    """config.json of a Hugging Face model directory, checked for a supported architecture."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: no config.json; --model hf:DIR needs a Hugging Face model directory "
                        "(config.json and model.safetensors or model-*-of-*.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); give the config.json that save_pretrained wrote") from None
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise UserError(f"{path}: architectures={arch} is not supported; supported: {', '.join(SUPPORTED)}")
    return raw


def model_fields(directory: Path) -> dict:
    """The `model.*` config fields (sizes for validation, data and the planner) of a model directory."""
    raw = read_config_json(directory)
    if raw["architectures"][0] == "GPT2LMHeadModel":
        return _gpt2_fields(raw)
    heads = raw["num_attention_heads"]
    return dict(layers=raw["num_hidden_layers"], hidden=raw["hidden_size"], heads=heads,
                kv_heads=raw.get("num_key_value_heads") or heads, ffn_hidden=raw["intermediate_size"],
                vocab=raw["vocab_size"], max_seq=raw.get("max_position_embeddings", 2048), mlp="swiglu",
                norm="rmsnorm", position="rope", tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bias=bool(raw.get("attention_bias", False)), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 1e4)),
                init_std=float(raw.get("initializer_range", 0.02)))


def _gpt2_fields(raw: dict) -> dict:
    hidden = raw.get("n_embd", raw.get("hidden_size"))
    heads = raw.get("n_head", raw.get("num_attention_heads"))
    return dict(layers=raw.get("n_layer", raw.get("num_hidden_layers")), hidden=hidden, heads=heads, kv_heads=heads,
                ffn_hidden=raw.get("n_inner") or 4 * hidden, vocab=raw["vocab_size"],
                max_seq=raw.get("n_positions", raw.get("max_position_embeddings", 1024)), mlp="gelu",
                norm="layernorm", position="learned", tie_embeddings=True, bias=True,
                norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), init_std=float(raw.get("initializer_range", 0.02)))
