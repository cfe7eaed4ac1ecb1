"""Hugging Face mixtures of experts for the bring-your-own-model tests: tiny Mixtral / Qwen2-MoE /
Qwen3-MoE models saved with save_pretrained (nothing downloaded), the library's own training loop
(plain torch AdamW, its load-balancing loss per sequence) and functions run on every rank of a
test world (module level: picklable)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.hf_tasks import global_params, pipeline_logits
from tests.helpers import make_config

SIZES = dict(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.02)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer 0 dense, layer 1 sparse; a gated shared expert; top-k probabilities not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2,
                       shared_expert_intermediate_size=48, norm_topk_prob=False)),
    # per-head q/k norms, renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16,
                       norm_topk_prob=True)),
}
TRAIN = ["train.global_batch=8", "train.seq_len=16", "train.min_lr_ratio=1.0", "train.steps=6"]


def save_tiny_moe(family: str, out: Path, **changes) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SIZES, **extra, **changes}))
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(out)
    return Path(out)


def _library_aux(model, router_logits: tuple, b: int, s: int) -> torch.Tensor:
    """The library's load_balancing_loss_func of each sequence, averaged over the sequences."""
    func = importlib.import_module(type(model).__module__).load_balancing_loss_func
    c = model.config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    per = [func(tuple(g.view(b, s, -1)[i] for g in router_logits), experts, c.num_experts_per_tok)
           for i in range(b)]
    return torch.stack(per).mean()


def _router_stats(router_logits: tuple, k: int) -> torch.Tensor:
    """(sparse layers, experts) assignments of the batch."""
    return torch.stack([F.one_hot(g.softmax(-1).topk(k, -1).indices, g.shape[-1]).sum((0, 1)) for g in router_logits])


def reference_moe_training(directory: Path, overrides: list[str]) -> dict:
    """The library model's own single-process loop: from_pretrained, plain torch AdamW, the same batches;
    loss = cross-entropy + router_aux_loss_coef x the load-balancing loss (per sequence, averaged)."""
    import transformers

    from threefold.data import Sampler, load_tokens

    cfg = make_config(overrides, "unused")
    t = cfg.train
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.train()
    initial = library_params(model)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):  # an identically zero gradient: frozen on both sides
            p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    losses, moe = [], []
    for step in range(t.steps):
        (batch,) = sampler.microbatches(step, 1)
        b, s = batch.inputs.shape
        out = model(input_ids=batch.inputs, output_router_logits=True)
        aux = model.config.router_aux_loss_coef * _library_aux(model, out.router_logits, b, s)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch.targets.flatten()) + aux
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        counts = _router_stats(out.router_logits, model.config.num_experts_per_tok)
        moe.append({"min": int(counts.min()), "max": int(counts.max()), "mean": float(counts.float().mean()),
                    "aux_loss": float(aux.detach())})
    return {"losses": losses, "moe": moe, "params": library_params(model), "initial": initial}


_OURS = ((r"^model\.embed_tokens\.", "embed."), (r"^model\.layers\.(\d+)\.", r"blocks.\1.layer."),
         (r"^model\.norm\.", "norm."), (r"^lm_head\.", "head."), (r"\.mlp\.gate\.", ".mlp.router."),
         (r"\.mlp\.shared_expert\.", ".mlp.shared."), (r"\.mlp\.shared_expert_gate\.", ".mlp.shared_gate."))


def library_params(model) -> dict[str, torch.Tensor]:
    """The library model's parameters under threefold's names (its fused experts' gate/up split)."""
    out = {}
    for name, p in model.named_parameters():
        for pattern, replacement in _OURS:
            name = re.sub(pattern, replacement, name)
        p = p.detach().clone()
        if name.endswith("experts.gate_up_proj"):
            gate, up = p.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "w_gate")], out[name.replace("gate_up_proj", "w_up")] = gate, up
        elif name.endswith("experts.down_proj"):
            out[name.replace("down_proj", "w_down")] = p
        else:
            out[name] = p
    return out


def train_moe_many(runs: list[tuple[list[str], str]], tokens: torch.Tensor) -> list[dict]:
    """Train each run; losses, `moe` metrics, every parameter whole, logits of `tokens` after training."""
    from threefold.train.trainer import Trainer

    out = []
    for overrides, run_out in runs:
        with contextlib.redirect_stderr(io.StringIO()):
            trainer = Trainer(make_config(overrides, run_out))
            records = trainer.run()
            after = pipeline_logits(trainer, tokens)
        out.append({"losses": [r["loss"] for r in records], "moe": [r["moe"] for r in records],
                    "params": global_params(trainer), "after": after})
    return out
