"""Typed, frozen configuration: one dataclass per concern, read from TOML plus overrides.

A config is built in three layers, later ones winning: dataclass defaults, a TOML file, then
`KEY=VALUE` overrides (the CLI's options are turned into such overrides). `model.preset`
supplies the defaults of every other `model.*` field. `Config.validate(world_size)` checks the
whole thing once, fills in derived values (dp) and returns the final, frozen config. Every
mistake raises `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from .errors import ConfigError
from .models.presets import PRESETS


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 4
    ffn_hidden: int = 128
    vocab: int = 256
    max_seq: int = 64
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position: Literal["learned", "rope"] = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 0  # 0: world_size / (tp * pp)
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    bucket_mb: float = 25.0  # gradient bucket size for the data-parallel reduction
    offload: Literal["none", "optimizer"] = "none"  # optimizer: masters + Adam states in host memory (ZeRO >= 1)


@dataclass(frozen=True)
class PipelineConfig:
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = "1f1b"
    virtual_stages: int = 1
    split: str = ""  # comma-separated first layer index of each stage after the first; "" = balanced
    balance: Literal["params", "time"] = "params"


@dataclass(frozen=True)
class PrecisionConfig:
    compute: Literal["fp32", "bf16", "fp16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16", "fp16", "compute"] = "fp32"
    initial_scale: float = 65536.0
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


@dataclass(frozen=True)
class RematConfig:
    policy: Literal["none", "full", "selective", "every-k"] = "none"
    every: int = 2  # for every-k: checkpoint one block in every k
    targets: str = "attn.core"  # for selective: comma-separated parts of each block (submodules or methods)


@dataclass(frozen=True)
class CompressConfig:
    """Gradient communication over dp (comm/compression/, docs/compression.md)."""

    method: Literal["none", "fp16", "bf16", "dgc", "onebit", "powersgd"] = "none"
    dgc_sparsity: float = 0.999  # fraction of entries NOT sent once the warm-up is over
    dgc_warmup_steps: int = 0  # density shrinks geometrically from 25% to 1 - dgc_sparsity over these steps
    dgc_momentum: float = 0.9  # with momentum correction it replaces train.momentum (SGD then runs without)
    dgc_momentum_correction: bool = True  # accumulate velocity (momentum) instead of raw gradients
    dgc_local_clip: bool = True  # clip each rank's gradient at train.grad_clip / sqrt(dp) before accumulating
    onebit_adam: bool = True  # onebit: 1-bit Adam (compressed momentum); false: 1-bit gradients, any optimizer
    powersgd_rank: int = 4
    warmup_steps: int = 0  # uncompressed steps before compression starts (1-bit, PowerSGD)
    error_feedback: bool = True  # keep what compression dropped and send it later (dgc, onebit, powersgd)
    hierarchical: bool = False  # dense sums: reduce in each node, all-reduce across nodes, broadcast


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks
    microbatches: int = 1  # per data-parallel rank per step (accumulation / pipeline)
    seq_len: int = 32
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: momentum SGD (what DGC and 1-bit gradients were made for)
    lr: float = 3e-4  # SGD needs a much larger one, e.g. 0.1-1
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1  # adamw: decoupled (p *= 1 - lr wd); sgd: L2 added to the gradient (use ~1e-4)
    beta1: float = 0.9  # adamw
    beta2: float = 0.95  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.9  # sgd; 0: plain SGD
    nesterov: bool = False  # sgd: Nesterov momentum
    grad_clip: float = 1.0  # clip by global norm; 0 disables
    seed: int = 0
    deterministic: bool = False


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | stdlib | a path (text file, directory of text, .npy tokens)


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 0  # save every N optimizer steps and at the last step; 0: never
    async_save: bool = False  # snapshot to host memory, write on a background thread
    resume: str = "none"  # none | auto (newest checkpoint that verifies) | a checkpoint or run directory
    keep: int = 3  # newest checkpoints kept; 0 keeps all
    init_from: str = ""  # a safetensors file of whole model tensors to start from (when not resuming)


@dataclass(frozen=True)
class RunConfig:
    out: str = "runs/latest"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = 1
    progress: bool = True
    tensorboard: bool = False
    plot: bool = True
    collective_timeout_s: float = 600.0  # the hang watchdog reports and stops the job after this


@dataclass(frozen=True)
class DebugConfig:
    """Debugging and reproducibility tools (observe/, docs/observe.md)."""

    history: int = 2048  # collectives kept in each rank's flight record; 0 turns the recorder off
    watchdog: bool = True  # report and stop when a collective is in flight too long
    hang_timeout_s: float = 0.0  # the watchdog's limit; 0 = run.collective_timeout_s
    hang_grace_s: float = 10.0  # how long the ranks wait for each other's flight records
    fingerprint_every: int = 0  # steps between checks that ranks issued the same collectives; 0 = off
    stats: bool = False  # per-rank step time split, loss, grad norm, stragglers (all-gathered each step)
    straggler_ratio: float = 1.5  # a rank whose compute time exceeds this x the median is a straggler
    nan_check: bool = False  # forward hooks name the first module with a non-finite output
    replica_check_every: int = 0  # steps between hash comparisons of dp replicas; 0 = off
    trace: bool = False  # DIR/trace/rank-N.json: Chrome / Perfetto trace of steps and collectives
    dump_params: bool = False  # DIR/params/rank-N.safetensors: final owned parameter boxes (parity)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests, on `rank` from the start of `step` (docs/observe.md).

    raise / kill: fail at that step (raise, or SIGKILL). kill_in_save: SIGKILL halfway through
    writing its file of the checkpoint of `step`. skip_collective: do not join the step's loss
    all-reduce and stall outside communication. nan: the output of `module` becomes NaN in that
    step. slow: sleep `delay_s` before the computation of every step from `step` on. perturb: that
    step's targets are shifted by one token id (the loss and the whole run change, as a broken
    layout would). `layout` ("dp,tp,pp") limits the fault to runs of that layout; "" = any.
    Only the first attempt of a job fails: a process restarted by the launcher does not.
    """

    rank: int = -1
    step: int = 0
    kind: Literal["raise", "kill", "kill_in_save", "skip_collective", "nan", "slow", "perturb"] = "raise"
    module: str = "blocks.0.mlp"
    delay_s: float = 0.2
    layout: str = ""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def validate(self, world_size: int) -> "Config":
        """Check everything against `world_size`; return the config with derived values set."""
        return _validate(self, world_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The whole config as TOML that `load_config` reads back to an equal Config."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES = {name: typing.get_type_hints(Config)[name] for name in SECTIONS}


# ---------------------------------------------------------------- building


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults <- TOML file at `path` <- `KEY=VALUE` overrides."""
    raw: dict[str, dict] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"file '{path}' does not exist; pass the path of a TOML file")
        try:
            loaded = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"'{path}' is not valid TOML ({e})") from None
        for section, values in loaded.items():
            if section not in SECTIONS:
                raise ConfigError(section, f"unknown config section; valid sections: {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(section, "must be a TOML table like [section]")
            for key, value in values.items():
                raw.setdefault(section, {})[key] = _check_value(section, key, value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(item, "overrides are KEY=VALUE, e.g. model.layers=4")
        section, _, name = key.strip().partition(".")
        _field_type(section, name)  # raises on unknown keys
        raw.setdefault(section, {})[name] = _parse_text(section, name, text.strip())
    return build_config(raw)


def build_config(raw: dict[str, dict]) -> Config:
    """A Config from {section: {key: typed value}}; `model.preset` fills the model defaults."""
    model_values = dict(raw.get("model", {}))
    preset = model_values.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
    sections = {}
    for section, cls in _SECTION_TYPES.items():
        values = dict(raw.get(section, {}))
        if section == "model":
            values = {**PRESETS[preset], **values, "preset": preset}
        sections[section] = cls(**values)
    return Config(**sections)


def with_overrides(config: Config, **sections: dict) -> Config:
    """A copy of `config` with some fields replaced, e.g. with_overrides(c, train={"steps": 3})."""
    changed = {}
    for section, values in sections.items():
        for name, value in values.items():
            _check_value(section, name, value)
        changed[section] = replace(getattr(config, section), **values)
    return replace(config, **changed)


def _field_type(section: str, name: str):
    if section not in SECTIONS:
        raise ConfigError(f"{section}.{name}", f"unknown config section '{section}'; valid sections: {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(_SECTION_TYPES[section])
    if name not in hints:
        raise ConfigError(f"{section}.{name}", f"unknown key; valid keys in [{section}]: {', '.join(hints)}")
    return hints[name]


def _check_value(section: str, name: str, value):
    """Type-check a value that arrived already typed (TOML, Python)."""
    kind = _field_type(section, name)
    key = f"{section}.{name}"
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(key, f"'{value}' is not one of {', '.join(map(str, choices))}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _parse_text(section: str, name: str, text: str):
    """Parse the text of a `KEY=VALUE` override into the field's type."""
    kind = _field_type(section, name)
    key = f"{section}.{name}"
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value = lowered in ("true", "1", "yes")
        elif kind is int:
            value = int(text)
        elif kind is float:
            value = float(text)
        else:
            value = text
    except ValueError:
        raise ConfigError(key, f"expected {kind.__name__}, got '{text}'") from None
    return _check_value(section, name, value)


# ---------------------------------------------------------------- validation


def _validate(c: Config, world_size: int) -> Config:
    p, m, t = c.parallel, c.model, c.train
    for key, value in [("parallel.tp", p.tp), ("parallel.pp", p.pp), ("train.steps", t.steps),
                       ("train.global_batch", t.global_batch), ("train.microbatches", t.microbatches),
                       ("train.seq_len", t.seq_len), ("pipeline.virtual_stages", c.pipeline.virtual_stages),
                       ("model.layers", m.layers), ("model.hidden", m.hidden), ("model.heads", m.heads),
                       ("model.kv_heads", m.kv_heads), ("model.vocab", m.vocab)]:
        if value < 1:
            raise ConfigError(key, f"must be at least 1, got {value}")
    if p.dp < 0:
        raise ConfigError("parallel.dp", f"must be at least 1 (or 0 for world/(tp*pp)), got {p.dp}")
    dp = p.dp or world_size // (p.tp * p.pp)
    if dp < 1 or dp * p.tp * p.pp != world_size:
        raise ConfigError(
            "parallel", f"layout dp={p.dp or 'auto'} x tp={p.tp} x pp={p.pp} does not match the world size "
            f"{world_size}; choose dp, tp and pp whose product is {world_size}")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero", f"unknown ZeRO stage {p.zero}; choose 0, 1, 2 or 3")
    if p.offload != "none" and p.zero == 0:
        raise ConfigError("parallel.offload", f"offload={p.offload} needs ZeRO stage 1, 2 or 3 (each rank offloads "
                          "its shard of the optimizer states); set --zero 1 or higher, or parallel.offload=none")
    if p.bucket_mb <= 0:
        raise ConfigError("parallel.bucket_mb", f"must be positive, got {p.bucket_mb}")
    pr = c.precision
    if pr.initial_scale <= 0 or pr.growth_factor <= 1 or not 0 < pr.backoff_factor < 1 or pr.growth_interval < 1:
        raise ConfigError("precision", "the loss scaler needs initial_scale > 0, growth_factor > 1, "
                          f"0 < backoff_factor < 1 and growth_interval >= 1; got {pr.initial_scale}, "
                          f"{pr.growth_factor}, {pr.backoff_factor}, {pr.growth_interval}")
    if c.remat.every < 1:
        raise ConfigError("remat.every", f"must be at least 1, got {c.remat.every}")
    if m.hidden % m.heads:
        raise ConfigError("model.hidden", f"{m.hidden} is not divisible by model.heads={m.heads}")
    if m.heads % m.kv_heads:
        raise ConfigError("model.kv_heads", f"model.heads={m.heads} is not a multiple of kv_heads={m.kv_heads}")
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError("model.hidden", f"rotary embeddings need an even head size, got {m.head_dim}")
    _validate_tensor_parallel(p, m, t)
    if t.seq_len > m.max_seq:
        raise ConfigError("train.seq_len", f"{t.seq_len} exceeds model.max_seq={m.max_seq}; raise model.max_seq")
    if t.global_batch % (dp * t.microbatches):
        raise ConfigError(
            "train.global_batch", f"{t.global_batch} is not divisible by dp x microbatches = {dp} x {t.microbatches}; "
            f"use a multiple of {dp * t.microbatches}")
    _validate_pipeline(c)
    source = c.data.source
    if source not in ("synthetic", "stdlib") and not Path(source).exists():
        raise ConfigError("data.source", f"path '{source}' does not exist; give a text file, a directory of "
                          "text files, a .npy token file, or 'synthetic' / 'stdlib'")
    ck = c.checkpoint
    if ck.resume not in ("none", "auto") and not Path(ck.resume).is_dir():
        raise ConfigError("checkpoint.resume", f"'{ck.resume}' is not a checkpoint directory; use auto, none or a path")
    for key, value in [("checkpoint.save_every", ck.save_every), ("checkpoint.keep", ck.keep)]:
        if value < 0:
            raise ConfigError(key, f"must be at least 0, got {value}")
    if ck.init_from and not Path(ck.init_from).is_file():
        raise ConfigError("checkpoint.init_from", f"'{ck.init_from}' is not a file; give a .safetensors file "
                          "written by `threefold ckpt export` (or with the same tensor names)")
    _validate_optimizer(t)
    _validate_compress(c.compress, p.zero, t)
    _validate_debug(c)
    if fault_applies(c.fault, (dp, p.tp, p.pp)) and c.fault.rank >= world_size:
        raise ConfigError("fault.rank", f"rank {c.fault.rank} does not exist in a world of {world_size}")
    return replace(c, parallel=replace(p, dp=dp))


def parse_layout(text: str, key: str) -> tuple[int, int, int]:
    """ "dp,tp,pp" -> (dp, tp, pp), each at least 1."""
    parts = text.split(",")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ConfigError(key, f"'{text}' is not a layout; write dp,tp,pp with positive integers, e.g. 2,1,1")
    return values


def fault_applies(fault: FaultConfig, layout: tuple[int, int, int]) -> bool:
    """Whether the injected fault is meant for a run of `layout` (dp, tp, pp)."""
    return fault.rank >= 0 and (not fault.layout or parse_layout(fault.layout, "fault.layout") == tuple(layout))


def _validate_debug(c: Config) -> None:
    d, f = c.debug, c.fault
    for key, value in [("debug.history", d.history), ("debug.fingerprint_every", d.fingerprint_every),
                       ("debug.replica_check_every", d.replica_check_every), ("debug.hang_timeout_s", d.hang_timeout_s),
                       ("fault.delay_s", f.delay_s)]:
        if value < 0:
            raise ConfigError(key, f"must be at least 0, got {value}")
    if d.hang_grace_s <= 0:
        raise ConfigError("debug.hang_grace_s", f"must be positive, got {d.hang_grace_s}")
    if c.run.collective_timeout_s <= 0:
        raise ConfigError("run.collective_timeout_s", f"must be positive, got {c.run.collective_timeout_s}")
    if d.straggler_ratio <= 1:
        raise ConfigError("debug.straggler_ratio", f"must exceed 1 (slowest / median), got {d.straggler_ratio}")
    if d.history == 0:
        for key, on in [("debug.watchdog", d.watchdog), ("debug.fingerprint_every", d.fingerprint_every),
                        ("debug.stats", d.stats), ("debug.trace", d.trace)]:
            if on:
                raise ConfigError(key, "needs the flight recorder, which debug.history=0 turns off; "
                                  "keep debug.history > 0 or turn this off")
    if f.layout:
        parse_layout(f.layout, "fault.layout")
    if f.kind == "nan" and not f.module:
        raise ConfigError("fault.module", "name the module whose output becomes NaN, e.g. blocks.0.mlp.up")


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


def _validate_optimizer(t: TrainConfig) -> None:
    if t.lr <= 0:
        raise ConfigError("train.lr", f"must be positive, got {t.lr}")
    if not 0.0 <= t.momentum < 1.0:
        raise ConfigError("train.momentum", f"must be in [0, 1), got {t.momentum}; e.g. 0.9")
    if t.nesterov and (t.optimizer != "sgd" or t.momentum == 0):
        raise ConfigError("train.nesterov", "Nesterov momentum needs train.optimizer=sgd with train.momentum > 0 "
                          f"(got optimizer={t.optimizer}, momentum={t.momentum})")
    if t.weight_decay < 0:
        raise ConfigError("train.weight_decay", f"must be at least 0, got {t.weight_decay}")


def _validate_compress(c: CompressConfig, zero: int, t: TrainConfig) -> None:
    """Ranges and the combinations with ZeRO that a compressor cannot serve."""
    if not 0.0 <= c.dgc_sparsity < 1.0:
        raise ConfigError("compress.dgc_sparsity", f"must be in [0, 1), got {c.dgc_sparsity}; e.g. 0.999")
    if not 0.0 <= c.dgc_momentum < 1.0:
        raise ConfigError("compress.dgc_momentum", f"must be in [0, 1), got {c.dgc_momentum}; e.g. 0.9")
    for key, value in [("compress.dgc_warmup_steps", c.dgc_warmup_steps), ("compress.warmup_steps", c.warmup_steps)]:
        if value < 0:
            raise ConfigError(key, f"must be at least 0, got {value}")
    if c.powersgd_rank < 1:
        raise ConfigError("compress.powersgd_rank", f"must be at least 1, got {c.powersgd_rank}")
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
    if method == "onebit" and c.onebit_adam and c.warmup_steps < 1:
        raise ConfigError("compress.warmup_steps", "1-bit Adam needs uncompressed warm-up steps to estimate the "
                          "variance it then freezes; set it to about 15-25% of train.steps")
    if c.hierarchical and method in ("dgc", "onebit"):
        raise ConfigError("compress.hierarchical", f"{method} exchanges with all-gather / all-to-all, which have no "
                          "hierarchical form here; use it with none, fp16, bf16 or powersgd")
    if c.hierarchical and zero >= 1:
        raise ConfigError("compress.hierarchical", "the hierarchical all-reduce replaces the all-reduce of plain data "
                          "parallelism; ZeRO reduce-scatters instead; use parallel.zero=0")


def _validate_pipeline(c: Config) -> None:
    pipe, pp, layers, m = c.pipeline, c.parallel.pp, c.model.layers, c.train.microbatches
    stages = pp * pipe.virtual_stages
    if stages > layers:
        raise ConfigError("parallel.pp", f"{stages} pipeline stages (pp x virtual_stages) but the model has only "
                          f"{layers} layers; use at most {layers} stages")
    if pipe.virtual_stages > 1 and pipe.schedule != "interleaved":
        raise ConfigError("pipeline.virtual_stages", f"{pipe.virtual_stages} virtual stages need "
                          f"pipeline.schedule=interleaved (got '{pipe.schedule}'); or set virtual_stages=1")
    if pp > 1 and pipe.schedule == "interleaved" and m < pp:
        raise ConfigError("train.microbatches", f"the interleaved schedule needs at least as many micro-batches as "
                          f"pipeline stages per chunk: {m} < pp={pp}; use train.microbatches >= {pp}")
    if pipe.split and pp > 1:
        from .pipeline.stage import parse_split

        parse_split(pipe.split, layers, stages)
