"""Hugging Face models for the bring-your-own-model tests: tiny `transformers` models saved with
save_pretrained (nothing downloaded), the reference training loop (the library model itself,
plain torch AdamW) and functions run on every rank of a test world (module level: picklable)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.helpers import make_config

HIDDEN = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
STEPS = 6
TRAIN = ["train.global_batch=8", "train.seq_len=16", "train.min_lr_ratio=1.0", f"train.steps={STEPS}"]


def save_tiny(family: str, out: Path, shard: str | None = None, **changes) -> Path:
    """A small random `transformers` model of `family` in `out` (config.json + model.safetensors, or
    shards of at most `shard` (e.g. "40KB") + model.safetensors.index.json)."""
    import transformers

    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**HIDDEN, **changes}))
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return Path(out)


def reference_training(directory: Path, overrides: list[str]) -> dict:
    """The library model's own single-process loop: from_pretrained, plain torch AdamW, the same batches."""
    import transformers

    from threefold.data import Sampler, load_tokens

    cfg = make_config(overrides, "unused")
    t = cfg.train
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if cfg.model.position == "learned" else {}
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **no_dropout)
    model.train()
    for name, p in model.named_parameters():
        # an identically zero gradient (softmax is shift invariant): frozen on both sides
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
        if name.endswith("c_attn.bias"):  # GPT-2: the key third of the fused q/k/v bias
            p.register_hook(lambda g: torch.cat([g[:g.shape[0] // 3], torch.zeros_like(g[g.shape[0] // 3:
                                                                                        2 * g.shape[0] // 3]),
                                                 g[2 * g.shape[0] // 3:]]))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    losses = []
    for step in range(t.steps):
        (batch,) = sampler.microbatches(step, 1)
        logits = model(input_ids=batch.inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], t.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "model": model}


def global_params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole, by global name, on every rank: each owned piece (coordinate 0 of the
    axes a copy is replicated over) put in place, then summed over the world."""
    import torch.distributed as dist

    from threefold.checkpoint.pieces import local_pieces, local_view

    parallel = trainer.parallel
    held = {}
    for name, p in parallel.module.named_parameters():
        place = parallel.placements[name]
        whole = held.setdefault(place.name, torch.zeros(place.global_shape))
        if all(trainer.mesh.rank(axis) == 0 for axis in place.replicated_over):
            for piece in local_pieces(place):
                index = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))
                whole[index] = local_view(p.detach(), place, piece).float()
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, {n: tuple(t.shape) for n, t in held.items()})
    out = {}
    for name, shape in sorted({k: v for d in shapes for k, v in d.items()}.items()):
        whole = held.get(name, torch.zeros(shape))
        dist.all_reduce(whole)
        out[name] = whole
    return out


def pipeline_logits(trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """Whole-vocabulary logits of this rank's part of the model, passed through the pipeline stages in
    order (point-to-point over pp); every rank of the last stage returns them, others None."""
    from threefold.parallel.tensor import gather_vocab

    parallel, comm, mesh = trainer.parallel, trainer.comm, trainer.mesh
    module, pp = parallel.module, mesh.size("pp")
    hidden = trainer.cfg.model.hidden
    with torch.no_grad():
        if pp == 1:
            return gather_vocab(module(tokens), comm, trainer.cfg.model.vocab)
        rank = mesh.rank("pp")
        x = torch.empty(*tokens.shape, hidden)
        if rank > 0:
            comm.recv(x, "pp", rank - 1)
        else:
            x = module.embed(tokens)
        for stage in module.stages:
            for i in stage.layers:
                x = module.layer(i)(x)
        if rank < pp - 1:
            comm.send(x.contiguous(), "pp", rank + 1)
            return None
        return gather_vocab(module.head(module.norm(x)), comm, trainer.cfg.model.vocab)


def train_hf(overrides: list[str], out: str, tokens: torch.Tensor | None = None, save_initial: bool = False) -> dict:
    """Train; return losses, every parameter whole by global name, logits before and after training
    (`save_initial`: a checkpoint of step 0 too)."""
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        before = pipeline_logits(trainer, tokens) if tokens is not None else None
        if save_initial:
            trainer.save_checkpoint()
        records = trainer.run()
        after = pipeline_logits(trainer, tokens) if tokens is not None else None
    return {"losses": [r["loss"] for r in records], "params": global_params(trainer),
            "before": before, "after": after, "rank": trainer.mesh.global_rank,
            "dtypes": {p.dtype for p in trainer.parallel.module.parameters()},
            "comm": [r.get("comm", {}).get("dp", {}) for r in records]}


def train_hf_many(runs: list[tuple[list[str], str]]) -> list[dict]:
    return [train_hf(overrides, out) for overrides, out in runs]


def start_memory(overrides: list[str], out: str) -> dict:
    """parallelize only: the model-tensor bytes this rank holds, and the bytes it read from the files."""
    from threefold.checkpoint.hf import pretrained
    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.models.registry import model_spec
    from threefold.observe.memory import storage_bytes
    from threefold.parallel import parallelize

    cfg = make_config(overrides, out).validate(torch.distributed.get_world_size())
    p = cfg.parallel
    mesh = Mesh(Layout(dp=p.dp, tp=p.tp, pp=p.pp), torch.device("cpu"))
    spec = pretrained(model_spec(cfg.model, cfg.train.seed))
    parallel = parallelize(spec, mesh, Comm(mesh), cfg)
    return {"held": storage_bytes(parallel.param_tensors()), "read": spec.weights.bytes_read,
            "allocated": parallel.materialised_bytes}


def train_with_logits(runs: list[tuple[list[str], str]], tokens: torch.Tensor) -> list[dict]:
    """`train_hf` of each run, with the whole-vocabulary logits of `tokens` after training."""
    return [train_hf(overrides, out, tokens) for overrides, out in runs]

