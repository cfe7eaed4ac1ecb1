"""The sections of a configuration: one typed, frozen dataclass per concern, and `Sections`, the
whole of them.

Plain data with its defaults and the few values derived from one section alone. `Config`
(load.py) is `Sections` with its behaviour (reading TOML and overrides, `validate`); the
checks (checks.py, moe_checks.py, elastic.py) read the sections from here, so they sit
between the two and nothing circles back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from ..errors import ConfigError
from ..schedules import registry  # the schedule registry: plain data

SCHEDULE_NAMES = tuple(registry.SCHEDULES)  # pipeline.schedule's choices: the registry's (schedules/registry.py)

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    head_size: int = 0  # attention head size; 0 = hidden / heads (DeepSeek-V3-sized: 96 for 128 heads of 7168)
    # tokens per piece of the output head + loss (models/loss.py): no logits kept for backward, one extra head
    # forward; 0 = the whole micro-batch's logits at once
    loss_chunk: int = 0
    # embedding and head rows padded to a multiple of this (the published presets: 128); the real vocabulary
    # stays `vocab`, the padded columns never count in the loss and are cut from the logits users see
    vocab_multiple: int = 1
    # mixture of experts (models/moe.py, docs/moe.md): experts = 0 is a dense model
    experts: int = 0  # routed experts of each sparse block
    experts_top_k: int = 2  # experts per token: 1 = Switch, 2 = Mixtral
    shared_experts: int = 0  # experts every token goes through (DeepSeek)
    expert_ffn_hidden: int = 0  # hidden size of one expert; 0 = ffn_hidden
    moe_every: int = 1  # a sparse block every N blocks ...
    moe_start: int = 0  # ... from this block on (earlier blocks dense, as DeepSeek-V3's first 3)
    expert_capacity: float = 0.0  # capacity factor per sequence (tokens dropped past it); 0 = dropless
    router_aux_weight: float = 0.01  # load-balancing loss weight (per sequence, Switch's E * sum f_e P_e)
    router_z_weight: float = 0.001  # router z-loss weight (mean logsumexp(logits)^2)
    # balancing: aux = the load-balancing loss above; bias = DeepSeek-V3's auxiliary-loss-free rule (a per-expert
    # bias on the scores for the top-k choice only, b_e += rate * sign(mean load - load_e) after each step) with
    # its sequence-wise balance loss weighted by router_seq_aux_weight (0 = off) in place of router_aux_weight
    router_balance: Literal["aux", "bias"] = "aux"
    router_bias_rate: float = 0.001  # the bias update speed (DeepSeek-V3's gamma); router_balance=bias only
    router_seq_aux_weight: float = 0.0001  # sequence-wise balance loss weight under router_balance=bias (alpha)
    # LoRA (parallel/lora.py, docs/lora.md): rank 0 = off; alpha 0 = the rank (scaling alpha / rank 1);
    # targets: comma-separated module names ("" = the attention and MLP projections)
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: str = ""
    # multi-token prediction (models/mtp.py, docs/models.md): DeepSeek-V3's extra depths, each predicting one
    # token further ahead with the shared embedding and head; 0 = off. Their loss is weighted mtp_weight / depth
    mtp_depth: int = 0
    mtp_weight: float = 0.3

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the head: `vocab` rounded up to a multiple of `vocab_multiple`."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def attn_width(self) -> int:
        """Width of the attention's q (and o's input): heads x head size."""
        return self.heads * self.head_dim

    @property
    def expert_width(self) -> int:
        return self.expert_ffn_hidden or self.ffn_hidden

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        """The module names `model.lora_targets` lists ("" : the attention and MLP projections)."""
        names = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return names or LORA_DEFAULT_TARGETS

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` is sparse (a mixture of experts) rather than a dense MLP."""
        return self.experts > 0 and index >= self.moe_start and (index - self.moe_start) % self.moe_every == 0


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 0  # 0: world_size / (cp * tp * pp)
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (parameters replicated over cp)
    # how attention gets the other ranks' keys and values (parallel/context.py, docs/context.md)
    cp_method: Literal["ring", "allgather", "ulysses"] = "ring"
    zero: int = 0
    ep: int = 1  # expert parallelism: carved out of dp, each ep rank holds experts / ep experts
    sequence_parallel: bool = False
    bucket_mb: float = 25.0  # gradient bucket size for the data-parallel reduction
    # ZeRO-3 communication in 8 bits with a scale per 256 values (comm/quantize.py, docs/zero.md)
    zero_weight_comm: Literal["none", "int8", "fp8"] = "none"  # the weight all-gathers (fp8: e4m3)
    zero_grad_comm: Literal["none", "int8"] = "none"  # the gradient reduce-scatter, as all-to-all + local sum
    zero_hpz: bool = False  # ZeRO-3's backward re-gathers from a copy sharded inside the node (parallel/hpz.py)
    offload: Literal["none", "optimizer", "nvme"] = "none"  # optimizer: masters + Adam states in host memory (ZeRO >= 1)
    # nvme: masters + optimizer moments in one scratch file per rank under offload_dir, streamed (parallel/nvme.py)
    offload_dir: str = ""
    offload_prefetch: int = 2  # nvme: units read ahead of the one being updated
    offload_block_mb: float = 64.0  # nvme: states per unit (one aligned read and write each)
    # nvme: fix malloc's mmap threshold so freed host buffers go back to the system (parallel/nvme.py
    # `return_freed_memory`): the resident floor of a streamed run, at a cost in host step time (docs/zero.md)
    offload_return_memory: bool = True
    # the world size dp and train.microbatches are written for; 0 = the actual world. In a smaller
    # world dp shrinks and accumulation grows to keep the global batch (set by --nnodes MIN:MAX)
    elastic_world: int = 0


@dataclass(frozen=True)
class PipelineConfig:
    schedule: Literal[SCHEDULE_NAMES] = registry.DEFAULT_SCHEDULE
    virtual_stages: int = 1
    split: str = ""  # comma-separated first layer index of each stage after the first; "" = balanced
    balance: Literal["params", "time"] = "params"


@dataclass(frozen=True)
class PrecisionConfig:
    # auto: bf16 on CUDA, fp32 elsewhere; fp8: the blocks' linears in float8 (parallel/fp8.py), the rest bf16;
    # mxfp8: the same linears in MXFP8 (e4m3, one power-of-two scale per 32 elements: parallel/mxfp8.py)
    compute: Literal["auto", "fp32", "bf16", "fp16", "fp8", "mxfp8"] = "auto"
    # the dtype gradients travel in over dp; auto: the compute dtype on CUDA, fp32 elsewhere
    reduce_dtype: Literal["auto", "fp32", "bf16", "fp16", "compute"] = "auto"
    tf32: bool = True  # on CUDA, fp32 matmuls and convolutions use TF32 tensor cores
    initial_scale: float = 65536.0
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    # with compute=fp8 (docs/fp8.md): torchao's scaling recipe; which block linears convert (auto: those whose
    # GEMM shape gains on this GPU, planner/compute.py fp8_gains; all: every one, e.g. for CPU emulation);
    # the first and last block stay bf16 unless false
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_linears: Literal["auto", "all"] = "auto"
    fp8_skip_first_last: bool = True

    @property
    def model_dtype(self) -> str:
        """The dtype of the model's parameters and activations: fp8 computes its linears in float8 on bf16 ones."""
        return "bf16" if self.compute in ("fp8", "mxfp8") else self.compute

    def for_device(self, device_type: str) -> "PrecisionConfig":
        """`auto` settled for a device: bf16 compute reduced in bf16 on CUDA, fp32 elsewhere."""
        cuda = device_type == "cuda"
        compute = ("bf16" if cuda else "fp32") if self.compute == "auto" else self.compute
        reduce = ("compute" if cuda else "fp32") if self.reduce_dtype == "auto" else self.reduce_dtype
        return replace(self, compute=compute, reduce_dtype=reduce)


@dataclass(frozen=True)
class RematConfig:
    policy: Literal["none", "full", "selective", "every-k"] = "none"
    every: int = 2  # for every-k: checkpoint one block in every k
    # for selective: comma-separated parts of each block (submodules or methods); "" = the model family's own
    # (ModelSpec.selective: attn.core for the reference decoder, layer.self_attn / attn for Hugging Face models)
    targets: str = ""
    # activation offload (parallel/remat.py `apply_offload`): cpu keeps what the chosen blocks save for
    # backward in host memory (pinned, copied on a side stream on CUDA) and brings it back ahead of their backward
    offload: Literal["none", "cpu"] = "none"
    # for offload=cpu: the blocks (global indices, comma-separated, ranges a-b, e.g. "0-3,6"); "" = every block
    offload_blocks: str = ""

    def offloaded(self, layers: int) -> tuple[int, ...]:
        """The global indices of the blocks whose saved activations go to host memory (none without offload)."""
        if self.offload == "none":
            return ()
        chosen = offload_block_set(self.offload_blocks, layers)
        return tuple(range(layers)) if chosen is None else tuple(sorted(chosen))


def offload_block_set(text: str, layers: int) -> frozenset[int] | None:
    """`remat.offload_blocks` ("0-3,6"; "" = every block) as global block indices (None: every block);
    ConfigError naming the key on a bad list."""
    if not text.strip():
        return None
    chosen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError("remat.offload_blocks", f"'{part}' is not a block index or a range a-b; give e.g. "
                              "'0-3,6' (empty: every block)") from None
        if not 0 <= first <= last < layers:
            raise ConfigError("remat.offload_blocks", f"'{part}' is outside the model's blocks 0..{layers - 1} "
                              "(or a range that decreases)")
        chosen.update(range(first, last + 1))
    return frozenset(chosen)


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
    warmup_steps: int = -1  # uncompressed steps before compression starts (1-bit, PowerSGD); -1 = automatic:
    # 20% of train.steps for 1-bit Adam (it needs them to estimate the variance it then freezes), else 0
    error_feedback: bool = True  # keep what compression dropped and send it later (dgc, onebit, powersgd)
    hierarchical: bool = False  # dense sums: reduce in each node, all-reduce across nodes, broadcast


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks
    microbatches: int = 1  # per data-parallel rank per step (accumulation / pipeline)
    seq_len: int = 32
    optimizer: Literal["adamw", "sgd", "muon"] = "adamw"  # sgd: momentum SGD (what DGC and 1-bit gradients were made for)
    # muon: orthogonalised momentum on hidden matrices, AdamW (beta1, beta2, eps) on the rest (optim/muon.py)
    lr: float = 3e-4  # SGD needs a much larger one, e.g. 0.1-1
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1  # adamw: decoupled (p *= 1 - lr wd); sgd: L2 added to the gradient (use ~1e-4)
    beta1: float = 0.9  # adamw
    beta2: float = 0.95  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.9  # sgd; 0: plain SGD
    nesterov: bool = False  # sgd: Nesterov momentum
    muon_momentum: float = 0.95  # muon: momentum of the hidden matrices
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per orthogonalisation
    muon_nesterov: bool = True  # muon: Nesterov momentum (the reference's default)
    grad_clip: float = 1.0  # clip by global norm; 0 disables
    seed: int = 0
    deterministic: bool = False
    eval_every: int = 0  # validation loss every N steps (and at the last); 0: never. Needs prepared data
    eval_batches: int = 4  # global batches of the validation split per evaluation (the same ones each time)
    # periodic synchronisation over dp (parallel/local_sgd.py, docs/local_sgd.md): replicas step alone and meet
    # every sync_every steps; 1 with outer_optimizer=none and easgd_alpha=0 is plain synchronous data parallelism
    sync_every: int = 1  # H: steps between parameter averages (local SGD / DiLoCo) or elastic pulls (EASGD tau)
    sync_warmup_steps: int = 0  # post-local SGD: synchronous steps (gradients summed every step) before switching
    sync_optimizer_state: bool = False  # also average the optimizer's moments (or momentum) at every sync
    outer_optimizer: Literal["none", "nesterov"] = "none"  # nesterov: DiLoCo's outer step on the averaged delta
    outer_lr: float = 0.7  # DiLoCo outer learning rate
    outer_momentum: float = 0.9  # DiLoCo outer Nesterov momentum
    easgd_alpha: float = 0.0  # > 0: elastic averaging SGD, each replica pulled towards a centre variable
    # torch.compile per block (parallel/compile.py, docs/gpu.md); auto: on with CUDA where compiled training is
    # known to work, eager on the CPU (settled for the run's device: Sections.compile_for)
    compile: bool | Literal["auto"] = "auto"

    @property
    def periodic(self) -> bool:
        """Replicas step alone between syncs (local SGD, DiLoCo or EASGD) instead of summing gradients every step."""
        return self.sync_every > 1 or self.outer_optimizer != "none" or self.easgd_alpha > 0


@dataclass(frozen=True)
class DataConfig:
    # synthetic | stdlib | a prepared directory (`threefold data prepare`: epochs, validation split)
    # | a path read at the byte level (text file, directory of text, .npy tokens)
    source: str = "synthetic"
    sources: str = ""  # a weighted mixture of prepared directories, "DIR:WEIGHT,DIR:WEIGHT"; replaces source
    skip_bad_documents: bool = False  # data prepare: skip documents that are not valid UTF-8 instead of stopping
    prefetch: int = 2  # steps whose batches are prepared ahead on a background thread; 0: in the step
    # whole documents packed into rows of seq_len + 1 tokens (padding, no document split unless longer than a
    # row): attention masked at document boundaries, positions restarting per document, the targets of
    # padding and of each document's last token left out of the loss (prepared data only; docs/context.md)
    pack: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    # save every N optimizer steps and at the last step; 0: never; "auto": the Young/Daly interval from
    # the save stall and step time measured in the run and mtbf_hours (train/autosave.py)
    save_every: int | Literal["auto"] = 0
    mtbf_hours: float = 50_000.0  # save_every=auto: mean time between failures of one GPU (Llama 3's cluster)
    restart_seconds: float = 300.0  # save_every=auto: time to restart the job and load the checkpoint
    async_save: bool = False  # snapshot to host memory, write on a background thread
    resume: str = "none"  # none | auto (newest checkpoint that verifies) | a checkpoint or run directory
    keep: int = 3  # newest checkpoints kept; 0 keeps all
    init_from: str = ""  # a safetensors file of whole model tensors to start from (when not resuming)
    # also keep each checkpoint's files in the memory of this node's launcher and a peer node's, and
    # resume from there (checkpoint/peer.py); needs threefold's launcher (--nproc / --nnodes)
    peer_copy: bool = False


@dataclass(frozen=True)
class RunConfig:
    out: str = ""  # the run directory; "" = a fresh runs/<date>-<time> (the CLI points runs/latest at it)
    id: str = ""  # the run that owns `out` (DIR/run.json), set when the directory is claimed
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    tensorboard: bool = False  # DIR/tensorboard; the same as tensorboard in `trackers`
    # experiment trackers, any of tensorboard, wandb, mlflow, comma-separated (observe/trackers.py, docs/observe.md)
    trackers: str = ""
    plot: bool = True
    collective_timeout_s: float = 600.0  # the hang watchdog reports and stops the job after this
    threads: int = 0  # torch's CPU threads per process; 0 = OMP_NUM_THREADS when set, else cores / local processes


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
    comm_semantics: str = "native"  # "nccl": gloo behaves as NCCL does for p2p batches (tests; docs/observe.md)
    compile_backend: str = "inductor"  # torch.compile backend of train.compile (tests: aot_eager, no code generation)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests, on `rank` from the start of `step` (docs/observe.md).

    raise / kill: fail at that step (raise, or SIGKILL). kill_in_save: SIGKILL halfway through
    writing its file of the checkpoint of `step`. skip_collective: do not join the step's loss
    all-reduce and stall outside communication. nan: the output of `module` becomes NaN in that
    step. slow: sleep `delay_s` before the computation of every step from `step` on. perturb: that
    step's targets are shifted by one token id (the loss and the whole run change, as a broken
    layout would). lose_node: the node whose launcher has `--node-rank` = `rank` loses its
    launcher (SIGKILL; its processes die with it) at the start of `step`; with `hold_file`, the
    processes of later attempts wait at the start of `step` while that file exists (a test's way
    to let a node join again before the run ends). `layout` ("dp,tp,pp" or "dp,tp,pp,cp") limits the fault to runs
    of that layout; "" = any. Only the first attempt of a job fails: a process restarted by the
    launcher does not; `slow` stays slow in every attempt (a straggler stays one). signal: send
    `signal` (a comma list of SIGTERM, SIGINT, SIGUSR1) to the launcher at the start of `step`
    and wait until it has come back to this rank; signal_rank: to this rank only.
    """

    rank: int = -1
    step: int = 0
    kind: Literal["raise", "kill", "kill_in_save", "skip_collective", "nan", "slow", "perturb",
                  "lose_node", "signal", "signal_rank"] = "raise"
    module: str = "blocks.0.mlp"
    delay_s: float = 0.2
    layout: str = ""
    hold_file: str = ""
    signal: str = "SIGTERM"


@dataclass(frozen=True)
class Sections:
    """Every section of a configuration (load.py's `Config` adds its behaviour)."""

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

    def to_dict(self) -> dict[str, dict[str, object]]:
        """{section: {field: value}}: dataclasses.asdict's result (every field is a scalar or a string,
        so nothing needs its deep copy, which cost ~10 ms per call, several calls per run)."""
        return {f.name: {g.name: getattr(section, g.name) for g in fields(section)}
                for f in fields(self) for section in (getattr(self, f.name),)}

    def compile_unknown(self) -> list[str]:
        """The settings under which compiled training is not known to work: refused with train.compile=true
        (data.pack, pipedream-2bw, remat.offload) or never compared with eager (docs/gpu.md, "--compile")."""
        p = self.parallel
        unknown = {"data.pack": self.data.pack,
                   "pipeline.schedule": p.pp > 1 and self.pipeline.schedule != registry.DEFAULT_SCHEDULE,
                   "remat.offload": self.remat.offload != "none", "model.experts": self.model.experts > 0,
                   "parallel.offload": p.offload != "none", "compress.method": self.compress.method != "none",
                   "train.sync_every": self.train.periodic}
        return [key for key, on in unknown.items() if on]

    def compile_for(self, device_type: str) -> bool:
        """`train.compile` settled for the device a run uses: true or false as chosen; `auto`: per-block compile
        with CUDA where compiled training is known to work (`compile_unknown` empty), eager on the CPU."""
        if self.train.compile != "auto":
            return bool(self.train.compile)
        return device_type == "cuda" and not self.compile_unknown()
