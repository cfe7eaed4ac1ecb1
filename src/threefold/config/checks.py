"""Checking a Config once against the world size: every inconsistency a user can make.

Each check raises `ConfigError` naming the key and the fix; `validate` returns the config
with its derived values (dp) filled in. What one value alone may be (its range, its choices)
is its domain (domains.py), checked first; the checks here relate keys to each other. Called
through `Config.validate(world_size)`; the checks read only the sections (sections.py) and the
domains, so load.py imports them and not the other way round.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .sections import (CheckpointConfig, CompressConfig, ModelConfig, ParallelConfig, Sections, TrainConfig,
                              offload_block_set)
from ..errors import ConfigError, UserError
from ..layout import Layout
from ..schedules.registry import SCHEDULES, VIRTUAL_SCHEDULE, check as check_schedule
from .installed import check_installed, mxfp8_refusal
from .debug_checks import fault_applies, validate_debug
from .domains import check_domains
from .moe_checks import validate_experts
from .mtp_checks import validate_mtp
from .muon_checks import validate_muon
from .nil_effects import _WARMED_UP, nil_effects

if TYPE_CHECKING:
    from ..data.tokenizer import TokenizerIdentity

S = TypeVar("S", bound=Sections)  # a Config comes back a Config


def validate(c: S, world_size: int) -> S:
    check_domains(c)  # a Config built from values (build_config) was checked already; one made by replace() not
    check_installed(c.run)  # run.trackers / run.tensorboard: the libraries asked for are installed
    if c.parallel.elastic_world and c.parallel.elastic_world != world_size:  # an elastic job on fewer nodes
        from .elastic import rederive

        return rederive(c, world_size, _validate)
    return _validate(c, world_size)


def _validate_checkpoint_paths(ck: CheckpointConfig) -> None:
    """checkpoint.resume a directory (or auto / none); checkpoint.init_from a file or a DCP directory."""
    if ck.resume not in ("none", "auto") and not Path(ck.resume).is_dir():
        raise ConfigError("checkpoint.resume", f"'{ck.resume}' is not a checkpoint directory; use auto, none or a path")
    if ck.init_from and not (Path(ck.init_from).is_file() or (Path(ck.init_from) / ".metadata").is_file()):
        raise ConfigError("checkpoint.init_from", f"'{ck.init_from}' is neither a file nor a torch.distributed."
                          "checkpoint directory (.metadata); give a .safetensors file written by `threefold ckpt "
                          "export` (or with the same tensor names) or a DCP directory")


def _validate(c: S, world_size: int) -> S:
    p, m, t = c.parallel, c.model, c.train
    for key, value in (("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.ep", p.ep)):
        if m.preset.startswith("py:") and value > 1:  # a user's nn.Module (models/py_module.py) has no plan
            raise ConfigError(key, f"{value} needs a plan, which {m.preset} does not have; use {key}=1 "
                              "(or describe the model as a ModelSpec)")
    layout = Layout.of(p, world_size)
    dp = layout.dp
    if dp < 1 or layout.world_size != world_size:
        cp = f" x cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(
            "parallel", f"layout dp={p.dp or 'auto'}{cp} x tp={p.tp} x pp={p.pp} does not match the world size "
            f"{world_size}; choose dp, {'cp, ' if cp else ''}tp and pp whose product is {world_size}")
    if p.cp > 1:
        _validate_context(c)
    if p.offload != "none" and p.zero == 0:
        raise ConfigError("parallel.offload", f"offload={p.offload} needs ZeRO stage 1, 2 or 3 (each rank offloads "
                          "its shard of the optimizer states); set --zero 1 or higher, or parallel.offload=none")
    if p.offload == "nvme" and not p.offload_dir:
        raise ConfigError("parallel.offload_dir", "offload=nvme keeps the optimizer states in files there; "
                          "name a directory on a local SSD, e.g. parallel.offload_dir=/scratch/threefold")
    _validate_fp8(c.precision.compute, m, p)
    _validate_activation_offload(c)
    if m.hidden % m.heads and not m.head_size:
        raise ConfigError("model.hidden", f"{m.hidden} is not divisible by model.heads={m.heads}")
    if m.heads % m.kv_heads:
        raise ConfigError("model.kv_heads", f"model.heads={m.heads} is not a multiple of kv_heads={m.kv_heads}")
    if m.vocab_multiple > 1 and m.preset.startswith("hf:"):
        raise ConfigError("model.vocab_multiple", "applies to threefold's own decoder; a Hugging Face model (hf:DIR) "
                          "keeps its config.json's vocabulary: set model.vocab_multiple=1")
    if m.vocab_multiple > 1 and m.padded_vocab % p.tp:
        raise ConfigError("model.vocab_multiple", f"pads model.vocab={m.vocab} to {m.padded_vocab} rows, which "
                          f"parallel.tp={p.tp} does not divide; use a vocab_multiple that is a multiple of tp")
    if m.loss_chunk and m.preset.startswith("hf:"):
        raise ConfigError("model.loss_chunk", "applies to threefold's own decoder; a Hugging Face model (hf:DIR) "
                          "computes its loss whole: set model.loss_chunk=0")
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError("model.hidden", f"rotary embeddings need an even head size, got {m.head_dim}")
    _validate_tensor_parallel(p, m, t)
    _validate_lora(c)
    validate_experts(c, dp)
    validate_mtp(c)
    validate_muon(c)
    if t.seq_len > m.max_seq:
        if m.preset.startswith("hf:") and m.position == "learned":
            raise ConfigError("train.seq_len", f"{t.seq_len} exceeds the {m.max_seq} rows of the model's learned "
                              f"position table (n_positions in config.json); use train.seq_len <= {m.max_seq}")
        longer = " (a longer context than config.json's: allowed, with one warning)" if m.preset.startswith("hf:") else ""
        raise ConfigError("train.seq_len", f"{t.seq_len} exceeds model.max_seq={m.max_seq}; raise model.max_seq"
                          f"{longer}, e.g. model.max_seq={t.seq_len}")
    if t.global_batch % (dp * t.microbatches):
        raise ConfigError(
            "train.global_batch", f"{t.global_batch} is not divisible by dp x microbatches = {dp} x {t.microbatches}; "
            f"use a multiple of {dp * t.microbatches}")
    _validate_pipeline(c)
    m = _validate_data(c)
    if c.data.pack:
        _validate_packing(c)
    _validate_checkpoint_paths(c.checkpoint)
    _validate_optimizer(t)
    _validate_compress(c.compress, p.zero, t)
    _validate_periodic(c, dp)
    for key, value in (("parallel.zero_weight_comm", p.zero_weight_comm),
                       ("parallel.zero_grad_comm", p.zero_grad_comm)):
        if value != "none" and p.zero != 3:
            raise ConfigError(key, f"{value} quantizes ZeRO-3's weight all-gathers and gradient reduce-scatters; "
                              f"set parallel.zero=3 (got zero={p.zero}), or {key}=none")
    if p.zero_hpz and p.zero != 3:
        raise ConfigError("parallel.zero_hpz", f"hpZ keeps a node-local copy of ZeRO-3's weight shards; set "
                          f"parallel.zero=3 (got zero={p.zero}), or parallel.zero_hpz=false")
    validate_debug(c)
    for rule, key in nil_effects(c, dp):
        if rule.refuse:
            raise ConfigError(key, rule.message(key, c))
    if fault_applies(c.fault, layout) and c.fault.rank >= world_size:
        raise ConfigError("fault.rank", f"rank {c.fault.rank} does not exist in a world of {world_size}")
    return replace(c, parallel=replace(p, dp=dp), model=m, compress=_compress_warmup(c.compress, t.steps))


def _validate_data(c: Sections) -> ModelConfig:
    """Check [data] and the evaluation keys; returns the model config with the vocabulary of the
    prepared data's tokenizer (the reference decoder's vocabulary is the data's)."""
    from ..data.prepared import data_tokenizer, is_prepared

    d, t = c.data, c.train
    source = d.source
    if not d.sources and source not in ("synthetic", "stdlib") and not Path(source).exists():
        raise ConfigError("data.source", f"path '{source}' does not exist; give a directory made by `threefold data "
                          "prepare`, a text file, a directory of text files, a .npy token file, or 'synthetic' / 'stdlib'")
    if t.eval_every and not (d.sources or is_prepared(source)):
        raise ConfigError("train.eval_every", f"validation needs a held-out split: train from a directory made by "
                          f"`threefold data prepare` (--data DIR), not '{source}'")
    try:
        tokenizer = data_tokenizer(source, d.sources)
        if tokenizer is not None and c.model.preset.startswith("hf:"):
            _check_model_tokenizer(tokenizer, Path(c.model.preset[3:]), d.sources or source)
    except UserError as e:
        raise ConfigError("", str(e)) from None
    if tokenizer is None or c.model.preset.startswith("hf:"):
        return c.model  # a Hugging Face model's vocabulary is its config.json's
    return replace(c.model, vocab=tokenizer.vocab_size)


def _validate_packing(c: Sections) -> None:
    """data.pack: whole documents need the boundaries a prepared directory records, and the document mask
    needs threefold's own decoder; the layouts packing is not wired into yet are refused (docs/context.md)."""
    from ..data.prepared import is_prepared

    d, m, p = c.data, c.model, c.parallel
    if not (d.sources or is_prepared(d.source)):
        raise ConfigError("data.pack", f"packs whole documents, whose boundaries only a directory made by `threefold "
                          f"data prepare` records, not '{d.source}'; train from one (--data DIR) or set data.pack=false")
    _own_attention(m, "data.pack", "to mask by document", "data.pack=false", c.train.seq_len)
    for on, what, fix in [(p.pp > 1, f"parallel.pp={p.pp}", "parallel.pp=1"),
                          (p.tp > 1, f"parallel.tp={p.tp}", "parallel.tp=1"),
                          (m.experts > 0, f"mixture-of-experts routing (model.experts={m.experts})", "a dense model"),
                          (c.train.compile is True, "train.compile=true", "train.compile=false"),
                          (c.fault.rank >= 0 and c.fault.kind == "perturb", "fault.kind=perturb", "another fault.kind")]:
        if on:
            raise ConfigError("data.pack", f"packed rows with {what} are not wired yet; use {fix} or data.pack=false")


def _check_model_tokenizer(data: TokenizerIdentity, model_dir: Path, data_dir: str) -> None:
    """Prepared data must come from the tokenizer of the `hf:DIR` model, when DIR ships one."""
    from ..data.tokenizer import TOKENIZER_FILE, HFTokenizer, check_tokenizer_match

    if (model_dir / TOKENIZER_FILE).is_file():
        check_tokenizer_match(data, HFTokenizer(model_dir).identity, data_dir)


def compress_warmup(c: CompressConfig, steps: int) -> int:
    """`compress.warmup_steps`, with -1 (automatic) resolved: 20% of the steps for 1-bit Adam, else 0."""
    if c.warmup_steps >= 0:
        return c.warmup_steps
    return max(1, steps // 5) if c.method == "onebit" and c.onebit_adam else 0


def _compress_warmup(c: CompressConfig, steps: int) -> CompressConfig:
    if c.method not in _WARMED_UP:
        return c  # the key means nothing to the other methods (left at its default: see NIL_EFFECTS)
    return replace(c, warmup_steps=compress_warmup(c, steps))


def _validate_fp8(compute: str, m: ModelConfig, p: ParallelConfig) -> None:
    """fp8 / mxfp8 convert the blocks.<i> of a ModelSpec's model; mxfp8 needs torchao's MX training and whole
    32-element blocks on each tp rank (installed.py `mxfp8_refusal`)."""
    if compute in ("fp8", "mxfp8") and m.preset.startswith("py:"):
        raise ConfigError("precision.compute", f"{compute} converts the linears of a model's blocks.<i>, which "
                          f"{m.preset} does not describe; use precision.compute=bf16 (or describe it as a ModelSpec)")
    if compute == "mxfp8":
        dims = {"model.hidden (attention width)": m.attn_width, "model.ffn_hidden": m.ffn_hidden}
        if m.kv_heads % p.tp == 0:
            dims["model.kv_heads x head size"] = m.kv_heads * m.head_dim
        refused = mxfp8_refusal(p.tp, dims)
        if refused is not None:
            raise ConfigError(*refused)


def _validate_tensor_parallel(p: ParallelConfig, m: ModelConfig, t: TrainConfig) -> None:
    """What tensor parallelism can split: whole heads, whole MLP features, whole sequence chunks.

    The vocabulary needs no check: it is padded to a multiple of tp.
    """
    if p.tp == 1:
        return
    if m.heads % p.tp:
        raise ConfigError("parallel.tp", f"model.heads={m.heads} attention heads cannot be split over tp={p.tp}; "
                          "choose a tp that divides model.heads")
    if m.kv_heads % p.tp and p.tp % m.kv_heads:
        raise ConfigError("parallel.tp", f"model.kv_heads={m.kv_heads} key/value heads can be neither split over "
                          f"tp={p.tp} nor replicated evenly; choose a tp that divides kv_heads or is a multiple of it")
    if m.ffn_hidden % p.tp:
        raise ConfigError("parallel.tp", f"model.ffn_hidden={m.ffn_hidden} MLP features cannot be split over "
                          f"tp={p.tp}; choose a tp that divides model.ffn_hidden")
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", f"{t.seq_len} is not divisible by parallel.tp={p.tp}, which sequence "
                          f"parallelism splits it over; use a multiple of {p.tp}")


def _asynchronous_pipeline(c: Sections) -> bool:
    """A pipeline whose schedule updates weights without a flush (pipedream-2bw), read off its registration."""
    return c.parallel.pp > 1 and not SCHEDULES[c.pipeline.schedule].synchronous


def _validate_lora(c: Sections) -> None:
    """model.lora_*: what LoRA does not combine with (parallel/lora.py, docs/lora.md; the values' ranges:
    domains.py)."""
    m, p = c.model, c.parallel
    if m.lora_rank == 0:
        for key, value in [("model.lora_alpha", m.lora_alpha), ("model.lora_dropout", m.lora_dropout),
                           ("model.lora_targets", m.lora_targets)]:
            if value:
                raise ConfigError(key, "has no effect unless model.lora_rank > 0; set model.lora_rank or remove it")
        return
    if not m.preset.startswith("hf:"):
        raise ConfigError("model.lora_rank", f"LoRA applies to a Hugging Face model (model.preset=hf:DIR), not "
                          f"model.preset={m.preset}; set model.lora_rank=0")
    if m.experts:
        raise ConfigError("model.lora_rank", "LoRA is not implemented for a mixture of experts; "
                          "set model.lora_rank=0")
    if p.sequence_parallel and p.tp > 1:
        raise ConfigError("model.lora_rank", "LoRA adapters are not split for sequence parallelism; "
                          "set parallel.sequence_parallel=false")
    if _asynchronous_pipeline(c):
        raise ConfigError("model.lora_rank", f"LoRA is not implemented with pipeline.schedule="
                          f"{c.pipeline.schedule} (weights updated without a flush); choose another schedule")


def _validate_optimizer(t: TrainConfig) -> None:
    if t.nesterov and (t.optimizer != "sgd" or t.momentum == 0):
        raise ConfigError("train.nesterov", "Nesterov momentum needs train.optimizer=sgd with train.momentum > 0 "
                          f"(got optimizer={t.optimizer}, momentum={t.momentum})")


def _validate_compress(c: CompressConfig, zero: int, t: TrainConfig) -> None:
    """The combinations with ZeRO that a compressor cannot serve."""
    method = c.method
    # ZeRO reduce-scatters gradients instead of all-reducing them: the compression hooks (which
    # replace that all-reduce) do not apply; a 16-bit wire does (the ZeRO reducer casts).
    if zero >= 1 and method in ("dgc", "onebit", "powersgd"):
        raise ConfigError("compress.method", f"{method} compresses the all-reduce of plain data parallelism; "
                          f"ZeRO-{zero} reduce-scatters gradients instead; use parallel.zero=0, or "
                          "compress.method none/fp16/bf16 with ZeRO")
    if method == "onebit" and c.onebit_adam and t.optimizer != "adamw":
        raise ConfigError("compress.onebit_adam", f"1-bit Adam replaces AdamW, not train.optimizer={t.optimizer}; "
                          "use train.optimizer=adamw, or compress.onebit_adam=false (1-bit gradients, any optimizer)")
    if method == "onebit" and c.onebit_adam and c.warmup_steps == 0:
        raise ConfigError("compress.warmup_steps", "1-bit Adam needs uncompressed warm-up steps to estimate the "
                          "variance it then freezes; set it to about 15-25% of train.steps")
    if c.hierarchical and method in ("dgc", "onebit"):
        raise ConfigError("compress.hierarchical", f"{method} exchanges with all-gather / all-to-all, which have no "
                          "hierarchical form here; use it with none, fp16, bf16 or powersgd")
    if c.hierarchical and zero >= 1:
        raise ConfigError("compress.hierarchical", "the hierarchical all-reduce replaces the all-reduce of plain data "
                          "parallelism; ZeRO reduce-scatters instead; use parallel.zero=0")


def _validate_periodic(c: Sections, dp: int) -> None:
    """Local SGD / DiLoCo / EASGD (train.sync_every and friends): EASGD's alpha against dp, and what they
    cannot combine with."""
    t = c.train
    if t.easgd_alpha * dp >= 1:
        raise ConfigError("train.easgd_alpha", f"must be in [0, 1/dp) = [0, {1 / dp:.3g}) so the centre moves towards "
                          f"the replicas (dp={dp}), got {t.easgd_alpha}; e.g. 0.9/dp/sync_every")
    if t.easgd_alpha > 0 and t.outer_optimizer != "none":
        raise ConfigError("train.easgd_alpha", "EASGD and DiLoCo are two outer algorithms; set "
                          "train.outer_optimizer=none or train.easgd_alpha=0")
    if not t.periodic:
        return
    if c.parallel.zero >= 1:
        sharded = "weights and optimizer states" if c.parallel.zero == 3 else "optimizer states"
        raise ConfigError("train.sync_every", f"ZeRO-{c.parallel.zero} shards {sharded}"
                          " across dp, the axis local SGD / DiLoCo / EASGD average over, so a "
                          "replica cannot step alone; use parallel.zero=0 (or train.sync_every=1)")
    if c.compress.method != "none":
        raise ConfigError("compress.method", f"{c.compress.method} compresses the every-step gradient all-reduce, "
                          "which periodic averaging (train.sync_every) removes; use compress.method=none")


def _own_attention(m: ModelConfig, key: str, need: str, off: str, seq_len: int) -> None:
    """Refuse (under `key`) a model without the attention seam that `need`s it: a module of one's own, and
    a Hugging Face model outside the families threefold builds (each has one: models/hf_attention.py -
    the dense Llama-shaped ones, GPT-2 and the mixtures of experts), whose sliding windows narrower than
    the `seq_len` sequence are refused too (a core takes no banded mask). (Packing a mixture of experts
    is refused by `_validate_packing` itself.)"""
    if m.preset.startswith("hf:"):
        from .families import FAMILIES, sliding_window
        from .hf import read_config_json

        try:
            raw = read_config_json(Path(m.preset[3:]))
        except UserError:
            raw = {"architectures": [""]}
        arch = raw["architectures"][0]
        family = f"the Hugging Face model {m.preset}{f' ({arch})' if arch else ''}"
        if arch not in FAMILIES:
            raise ConfigError(key, f"{family} has no attention seam {need} (the families threefold builds have "
                              f"one: {', '.join(FAMILIES)}); use one of them, threefold's own decoder or {off}")
        window = sliding_window(raw)
        if window is not None and window < seq_len:
            raise ConfigError(key, f"{family} has sliding-window attention (a window of {window} tokens, narrower "
                              f"than train.seq_len={seq_len}), which the attention seam does not compute; use "
                              f"train.seq_len={window} or less, or {off}")
    if m.preset.startswith("py:"):
        raise ConfigError(key, f"model.preset={m.preset}: a module of your own has no attention {need}; use "
                          f"threefold's own decoder or {off}")


def _validate_context(c: Sections) -> None:
    """parallel.cp > 1: the sequence splits into 2 cp zigzag chunks; ulysses splits the heads over cp;
    the layouts context parallelism is not wired into yet are refused (docs/context.md). Every pipeline
    schedule takes cp (pipedream-2bw too: train/two_bw_step.py splits its micro-batches), and so do
    experts under sequence parallelism (the routers' statistics summed over tp and cp: parallel/expert.py)."""
    p, m, t = c.parallel, c.model, c.train
    cp = p.cp
    if t.seq_len % (2 * cp):
        raise ConfigError("train.seq_len", f"{t.seq_len} is not a multiple of 2 x parallel.cp = {2 * cp} (the zigzag "
                          f"chunks of context parallelism); choose train.seq_len divisible by {2 * cp}")
    if p.cp_method == "ulysses" and (m.heads % (cp * p.tp) or m.kv_heads % (cp * p.tp)):
        over = f"parallel.cp={cp}" if p.tp == 1 else f"parallel.cp x parallel.tp = {cp * p.tp} (tp splits the heads first)"
        raise ConfigError("parallel.cp_method", f"ulysses: {m.heads} query heads and {m.kv_heads} key/value heads "
                          f"must both be divisible by {over}; use parallel.cp_method=ring or allgather, "
                          "or a cp dividing both")
    _own_attention(m, "parallel.cp", "context parallelism can split", "parallel.cp=1", t.seq_len)
    if m.experts > 0 and m.expert_capacity > 0:
        raise ConfigError("model.expert_capacity", f"{m.expert_capacity:g}: under context parallelism routing is "
                          "dropless (capacity is a matter of positions, and each cp rank holds zigzag chunks); use "
                          "model.expert_capacity=0 or parallel.cp=1")
    for key, on, what in [("train.sync_every", t.periodic, "periodic replica syncs (local SGD, DiLoCo, EASGD)"),
                          ("remat.offload", c.remat.offload != "none", f"remat.offload={c.remat.offload}"),
                          ("compress.method", c.compress.method != "none", f"compress.method={c.compress.method}"),
                          ("compress.hierarchical", c.compress.hierarchical, "compress.hierarchical=true"),
                          ("parallel.zero_hpz", p.zero_hpz, "parallel.zero_hpz=true")]:
        if on:
            raise ConfigError(key, f"{what} with parallel.cp={cp} is not wired yet; use parallel.cp=1 or drop it")


def _validate_pipeline(c: Sections) -> None:
    pipe, pp, layers, m = c.pipeline, c.parallel.pp, c.model.layers, c.train.microbatches
    kind = SCHEDULES[pipe.schedule]
    chunks = kind.chunks_for(pipe.virtual_stages)
    if pipe.virtual_stages > 1 and kind.chunks is not None:
        raise ConfigError("pipeline.virtual_stages", f"{pipe.virtual_stages} virtual stages need "
                          f"pipeline.schedule={VIRTUAL_SCHEDULE} (got '{pipe.schedule}'"
                          + (f", which places {kind.chunks} chunks per rank itself" if kind.chunks > 1 else "")
                          + "); or set virtual_stages=1")
    stages = pp * chunks
    if stages > layers:
        raise ConfigError("parallel.pp", f"{stages} pipeline stages (pp x {chunks} chunks per rank) but the model "
                          f"has only {layers} layers; use at most {layers} stages")
    problem = check_schedule(pipe.schedule, pp, m, pipe.virtual_stages) if pp > 1 else None
    if problem:
        raise ConfigError("train.microbatches", problem)
    if pipe.split and pp > 1:
        parse_split(pipe.split, layers, stages)
    if _asynchronous_pipeline(c):  # pipedream-2bw: updates without a flush
        _validate_two_bw(c)


def _validate_two_bw(c: Sections) -> None:
    """PipeDream-2BW (pipeline/two_bw.py): each stage steps alone when its backward of a batch ends, so
    nothing that needs every stage's gradient at once (or a synchronous step) goes with it."""
    pp, m, t, p = c.parallel.pp, c.train.microbatches, c.train, c.parallel
    why = "pipedream-2bw updates each stage alone, as soon as its last backward of a batch ends"
    refusals = (
        (m < pp, "train.microbatches", f"pipedream-2bw needs at least as many micro-batches as pipeline ranks "
                                       f"({m} < pp={pp}); use train.microbatches >= {pp}"),
        (c.model.tie_embeddings, "model.tie_embeddings", f"{why}; the tied embedding and head would have to meet "
                                                         "between the first and last stage (a flush); set "
                                                         "model.tie_embeddings=false"),
        (c.precision.compute == "fp16", "precision.compute", f"{why}; fp16's loss scaler skips steps of all "
                                                             "stages together; use precision.compute=bf16 or fp32"),
        (p.zero > 0, "parallel.zero", "pipedream-2bw runs with plain data parallelism; set parallel.zero=0"),
        (p.tp > 1, "parallel.tp", "pipedream-2bw runs without tensor parallelism here; set parallel.tp=1"),
        (p.ep > 1, "parallel.ep", "pipedream-2bw runs without expert parallelism here; set parallel.ep=1"),
        (c.model.experts > 0, "model.experts", "the steps of pipedream-2bw do not wait for each other, and the "
                                               "routers' metrics are summed over the pipeline stages at every step "
                                               "(a wait); use a dense model (model.experts=0) or another schedule"),
        (t.compile is True, "train.compile", "pipedream-2bw runs its stages uncompiled; set train.compile=false"),
        (c.remat.policy != "none", "remat.policy", "pipedream-2bw runs without activation checkpointing here; "
                                                   "set remat.policy=none"),
        (t.eval_every > 0, "train.eval_every", "an evaluation would run the pipeline while pipedream-2bw has "
                                               "micro-batches in flight; set train.eval_every=0"),
        (t.periodic, "train.sync_every", "pipedream-2bw and periodic averaging are two asynchronous schemes; "
                                         "use one (train.sync_every=1)"),
        (c.compress.method != "none", "compress.method", "pipedream-2bw exchanges exact gradients over dp; set "
                                                         "compress.method=none"),
    )
    for refused, key, message in refusals:
        if refused:
            raise ConfigError(key, message)


def parse_split(text: str, num_layers: int, num_stages: int) -> list[int]:
    """`pipeline.split` ("4,8,12") -> stage bounds [0, 4, 8, 12]; ConfigError on a bad list."""
    try:
        cuts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("pipeline.split", f"'{text}' is not a comma-separated list of layer indices, "
                          "e.g. '4,8,12'") from None
    if len(cuts) != num_stages - 1:
        raise ConfigError("pipeline.split", f"{len(cuts)} boundaries for {num_stages} stages (pp x virtual_stages); "
                          f"give {num_stages - 1}: the first layer of every stage after the first")
    bounds = [0] + cuts
    if any(b >= a for b, a in zip(bounds, bounds[1:])) or cuts and cuts[-1] >= num_layers:
        raise ConfigError("pipeline.split", f"boundaries {cuts} must increase strictly within 1..{num_layers - 1} "
                          "so that every stage holds at least one layer")
    return bounds


def _validate_activation_offload(c: Sections) -> None:
    """remat.offload=cpu (parallel/remat.py): the block list parses, and the combinations it cannot serve
    are refused."""
    r = c.remat
    if r.offload == "none":
        return
    offload_block_set(r.offload_blocks, c.model.layers)
    if c.train.compile is True:
        raise ConfigError("remat.offload", "the offload's saved-tensor hooks run in Python, outside a compiled "
                          "graph; set train.compile=false or remat.offload=none")
    if _asynchronous_pipeline(c):  # pipedream-2bw
        raise ConfigError("remat.offload", "pipedream-2bw keeps stashed weight versions that the offload would "
                          "copy as activations; set remat.offload=none")


# --- options that change nothing ---------------------------------------------------------------
