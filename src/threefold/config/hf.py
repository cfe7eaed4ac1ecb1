"""A Hugging Face model directory's config.json, read as threefold's `model.*` fields.

Plain JSON, no torch and no `transformers`: the config (validation, `threefold plan --model
hf:DIR`, the data pipeline's vocabulary) learns a directory's sizes from here, and the model
families (models/hf_causal.py, models/hf_gpt2.py, models/hf_moe.py) check the directory with the
same reader. A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) sets the `model.*` expert keys
(`MoEShape`), so expert parallelism and the pp / sequence-parallel refusals are checked as for the
reference decoder; what the adapter does not build is refused here with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .families import FAMILIES  # plain data: the one table of families (no torch)

# all three read from the family registry (config/families.py)
MOE = tuple(arch for arch, family in FAMILIES.items() if family.experts)
# config.json's model_type -> the architecture threefold builds for it
ARCHITECTURES = {family.model_type: arch for arch, family in FAMILIES.items()}
SUPPORTED = tuple(FAMILIES)
# dropout a config.json may ask for; every family trains without it (masks drawn per rank would break tensor
# parallelism and parity), so the start warns and an export writes 0
DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


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
    raw["architectures"] = [_architecture(raw, path)]
    _refuse_attention_variants(raw, path)
    return raw


def _architecture(raw: dict, path: Path) -> str:
    """The architecture config.json claims, checked against its model_type (which picks the library's
    config class); without `architectures`, the model_type's."""
    kind = raw.get("model_type")
    arch = (raw.get("architectures") or [None])[0]
    if arch is None:
        if kind not in ARCHITECTURES:
            raise UserError(f"{path}: no architectures and model_type={kind} is not supported; supported model "
                            f"types: {', '.join(ARCHITECTURES)}")
        return ARCHITECTURES[kind]
    if arch not in SUPPORTED:
        raise UserError(f"{path}: architectures={arch} is not supported; supported: {', '.join(SUPPORTED)}")
    if kind is not None and ARCHITECTURES.get(kind) != arch:
        raise UserError(f"{path}: architectures={arch} but model_type={kind}, which is "
                        f"{ARCHITECTURES.get(kind, 'not a supported type')}; a config.json describes one model: "
                        "restore the one the weights were saved with")
    return arch


def dropout_asked(raw: dict) -> dict[str, float]:
    """The dropout probabilities above 0 that a config.json asks for."""
    return {key: raw[key] for key in DROPOUT if isinstance(raw.get(key), (int, float)) and raw[key] > 0}


# attention features a config can ask for that the families here do not compute: refused, never ignored
_UNBUILT = {"attn_logit_softcapping": "a soft-cap of the attention logits",
            "final_logit_softcapping": "a soft-cap of the output logits",
            "attention_chunk_size": "chunked (local) attention", "query_pre_attn_scalar": "a query scale",
            "sliding_window_pattern": "alternating local/global layers"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _refuse_attention_variants(raw: dict, path: Path) -> None:
    for key, what in _UNBUILT.items():
        if raw.get(key) not in (None, 0, 0.0, False):
            raise UserError(f"{path}: {key}={raw[key]} asks for {what}, which threefold does not implement; "
                            f"remove {key} (or set it to null) only if the model was trained without it")
    unknown = sorted(set(raw.get("layer_types") or ()) - set(_LAYER_TYPES))
    if unknown:
        raise UserError(f"{path}: layer_types holds {', '.join(unknown)}, which threefold does not implement "
                        f"(it builds {' and '.join(_LAYER_TYPES)})")


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
                init_std=float(raw.get("initializer_range", 0.02)), **_moe_fields(raw, directory))


def _gpt2_fields(raw: dict) -> dict:
    hidden = raw.get("n_embd", raw.get("hidden_size"))
    heads = raw.get("n_head", raw.get("num_attention_heads"))
    return dict(layers=raw.get("n_layer", raw.get("num_hidden_layers")), hidden=hidden, heads=heads, kv_heads=heads,
                ffn_hidden=raw.get("n_inner") or 4 * hidden, vocab=raw["vocab_size"],
                max_seq=raw.get("n_positions", raw.get("max_position_embeddings", 1024)), mlp="gelu",
                norm="layernorm", position="learned", tie_embeddings=True, bias=True,
                norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)), init_std=float(raw.get("initializer_range", 0.02)))


@dataclass(frozen=True)
class MoEShape:
    """The mixture of experts of a Mixtral / Qwen-MoE config.json: E experts of width `width`, top
    k, the top-k probabilities renormalised or not (Mixtral always; Qwen `norm_topk_prob`), the
    sparse layers, the shared expert's width (Qwen2-MoE; 0: none) and the load-balancing loss
    weight (0 unless `output_router_logits`: the library adds it to the training loss only then)."""

    experts: int
    top_k: int
    width: int
    norm_topk: bool
    every: int  # layer i is sparse when (i + 1) % every == 0
    shared_width: int
    aux_coef: float

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.every == 0


def moe_shape(raw: dict, directory: Path) -> MoEShape | None:
    """The experts of a config.json (None for a dense architecture)."""
    arch = raw["architectures"][0]
    if arch not in MOE:
        return None
    where = Path(directory) / "config.json"
    if arch == "MixtralForCausalLM":
        every, width, norm_topk = 1, raw["intermediate_size"], True
    else:
        if raw.get("mlp_only_layers"):
            raise UserError(f"{where}: mlp_only_layers={raw['mlp_only_layers']} is not supported (a dense MLP in "
                            "chosen layers); save the model with mlp_only_layers=[] or use decoder_sparse_step")
        every = raw.get("decoder_sparse_step", 1)
        width, norm_topk = raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False))
    if raw.get("router_jitter_noise"):
        raise UserError(f"{where}: router_jitter_noise={raw['router_jitter_noise']} is not supported (noise drawn "
                        "per rank); set it to 0")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act={act} is not supported for experts; only silu (SwiGLU)")
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    return MoEShape(experts=experts, top_k=raw.get("num_experts_per_tok", 2), width=width, norm_topk=norm_topk,
                    every=every, shared_width=raw.get("shared_expert_intermediate_size", 0) or 0,
                    aux_coef=float(raw.get("router_aux_loss_coef", 0.001)) if raw.get("output_router_logits") else 0.0)


def _moe_fields(raw: dict, directory: Path) -> dict:
    """The `model.*` mixture-of-experts fields (config checks, expert parallelism, the planner)."""
    moe = moe_shape(raw, directory)
    if moe is None:
        return {}
    return dict(experts=moe.experts, experts_top_k=moe.top_k, expert_ffn_hidden=moe.width,
                shared_experts=round(moe.shared_width / moe.width), moe_every=moe.every, moe_start=moe.every - 1,
                expert_capacity=0.0, router_aux_weight=moe.aux_coef, router_z_weight=0.0)
