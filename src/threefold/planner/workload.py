"""What the planner reasons about: a workload (model + batch) and a strategy (layout + knobs).

`Strategy` is one point of the search space; `from_config` reads the same knobs out of a
threefold `Config`, so a planned layout and a real run are described by the same object.
Parameter counts here are analytic (no tensors) and equal `models.decoder.count_parameters`
(a unit test checks every preset); `rank_parameters` says which of them one rank holds under
tensor and pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..config import Config, ModelConfig
from ..layout import Layout
from ..schedules.registry import DEFAULT_SCHEDULE
from .moe import expert_parameters, sparse_block_extra, sparse_block_rank_extra, sparse_blocks

IMPLEMENTATIONS = ("threefold", "hf-llama")  # whose activations: the reference decoder or transformers' Llama
# the attention kernel's work: "flash" (SDPA's fused causal kernels on a GPU skip the masked half of
# the s x s scores: threefold, torchtitan, Megatron-LM since 2023) or "dense" (the whole s x s
# matrix is computed and masked: Megatron-LM / DeepSpeed / metaseq of 2021-2022)
ATTENTION_KERNELS = ("flash", "dense")
# how the pipeline's stages exchange activations and gradients (planner/pipeline_p2p.py): "batched"
# (threefold), "scatter-gather" (Megatron-LM of 2021-22), "deepspeed" (DeepSpeed's
# PipelineEngine: blocking sends and receives one after the other, tensors partitioned over tp)
PIPELINE_P2P = ("batched", "scatter-gather", "deepspeed")
REGATHER = ("region", "linear", "exposed")
# whose cross-entropy kernels run over the logits (planner/compute.py `loss_bytes_per_logit`): threefold's,
# Megatron's vocabulary-parallel one, torch's F.cross_entropy of fp32 logits
LOSSES = ("threefold", "megatron", "torch")
# what `selective` checkpointing keeps (planner/activations.py `op_sac_items`): threefold's (the attention core
# recomputed) or torchtitan's op-level policy (every op recomputed but the matmuls - every second one of them
# recomputed too - and the attention kernel)
SELECTIVE = ("threefold", "torchtitan-op")
# how ZeRO-2/3 holds gradients (planner/memory.py): threefold's buckets, or PyTorch's FSDP2 (fully_shard) with its
# fp32 reduce_dtype - the unit's gradients cast to fp32 for the reduce-scatter, and under a pipeline the stage's
# gradients accumulated unsharded in fp32 until the last micro-batch (torch.distributed.pipelining turns the
# gradient sync off for the others: stage.py `backward_maybe_with_nosync`; FSDP2 `to_accumulated_grad_if_needed`),
# or DeepSpeed's ZeRO-3 of 2021, which gathered parameter by parameter (planner/dp_comm.py `_units`)
SHARDING = ("threefold", "fsdp2", "deepspeed-2021")
# how a block's memory-bound work between the GEMMs runs (planner/compute.py `elementwise_bytes_per_token`): "fused"
# (one read and one write per element and operation: fused norm, activation, rotary and add kernels, as Megatron's,
# llm-foundry's and compiled code run them) or "torchtitan-eager" (torchtitan's Llama block run eager, as its
# 2024-12 bf16 benchmark rows did: an RMSNorm of fp32 steps, rotary positions through complex fp32, repeated k and
# v heads, SiLU then a product)
ELEMENTWISE = ("fused", "torchtitan-eager")
# the dtype the gradients' reduction runs in (planner/dp_comm.py): the gradients' own ("compute": bf16 under bf16
# compute, threefold's and Megatron's default) or fp32 (FSDP's MixedPrecision reduce_dtype=float32: Composer's
# `mixed_precision: DEFAULT` from v0.16.4 on - composer/trainer/mosaic_fsdp_utils.py, param_dtype the compute dtype,
# reduce_dtype torch.float32 - which llm-foundry's MPT benchmarks ran; twice the bytes on the wire)
GRAD_REDUCE = ("compute", "fp32")


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int
    implementation: str = "threefold"
    attention: str = "flash"  # ATTENTION_KERNELS: what the attention core executes (time, not model FLOPs)
    # whether the data-parallel gradient reduction overlaps the last backward (threefold, torch DDP/FSDP,
    # Megatron-core since 2023) or runs after the pipeline flush (Megatron-LM / DeepSpeed of 2021-22)
    grad_overlap: bool = True
    pipeline_p2p: str = "batched"  # PIPELINE_P2P
    # whether the software overlaps a chunk's expert all-to-all with the paired chunk's compute in the
    # schedule's overlapped pairs (DeepSeek-V3's DualPipe); None: as threefold's runtime does (planner/moe.py
    # pairs_overlap: dualpipev's pairs with ep > 1, unless tp > 1, ZeRO-3 or recomputation keep the sides apart)
    a2a_overlap: bool | None = None
    # when the sequence-parallel regather of a region's saved shard is issued (REGATHER): at the region's
    # backward start (threefold), inside the linear's backward under its input-gradient GEMM (Megatron-LM),
    # or not overlapped
    regather: str = "region"
    loss: str = "threefold"  # LOSSES
    selective: str = "threefold"  # SELECTIVE
    sharding: str = "threefold"  # SHARDING
    elementwise: str = "fused"  # ELEMENTWISE
    grad_reduce: str = "compute"  # GRAD_REDUCE
    optimizer: str = "adamw"  # train.optimizer, a name of optim/registry.py: its states and step (planner/optimizer.py)

    def __post_init__(self):
        for name, value, choices in (("implementation", self.implementation, IMPLEMENTATIONS),
                                     ("attention", self.attention, ATTENTION_KERNELS),
                                     ("pipeline_p2p", self.pipeline_p2p, PIPELINE_P2P),
                                     ("regather", self.regather, REGATHER), ("loss", self.loss, LOSSES),
                                     ("selective", self.selective, SELECTIVE),
                                     ("sharding", self.sharding, SHARDING),
                                     ("elementwise", self.elementwise, ELEMENTWISE),
                                     ("grad_reduce", self.grad_reduce, GRAD_REDUCE)):
            if value not in choices:
                raise ValueError(f"Workload.{name}: unknown '{value}'; one of {', '.join(choices)}")

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@lru_cache(maxsize=None)
def _schedule_facts(schedule: str, virtual_stages: int) -> tuple[int, bool, str]:
    """(chunks per rank, whether it takes virtual stages, placement) of a schedule's registration, once per
    (schedule, virtual stages): the search asks for them for every layout it prices."""
    from ..schedules.registry import SCHEDULES  # pure Python: the registry the runtime reads
    kind = SCHEDULES[schedule]
    return kind.chunks_for(virtual_stages), kind.needs_virtual_stages, kind.placement


@dataclass(frozen=True)
class Strategy(Layout):
    """A layout (dp, tp, pp, ep, cp: layout.py, the record the runtime reads) with the knobs the planner
    searches beside it."""

    zero: int = 0
    microbatches: int = 1  # per data-parallel rank per step
    remat: str = "none"  # none | selective | full | every-k
    schedule: str = DEFAULT_SCHEDULE  # a name of the registry, schedules/registry.py (only matters when pp > 1)
    virtual_stages: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"  # fp32 | bf16 | fp16
    remat_every: int = 2
    bucket_mb: float = 25.0
    # slow links (planner/slow_links.py): periodic synchronisation and ZeRO++-style ZeRO-3 communication
    sync_every: int = 1  # H: replicas meet every H steps (local SGD / DiLoCo); needs zero = 0
    outer: str = "none"  # none (local SGD) | nesterov (DiLoCo: outer parameters and momentum kept)
    weight_comm: str = "none"  # ZeRO-3 weight all-gathers: none (compute dtype) | int8 | fp8
    grad_comm: str = "none"  # ZeRO-3 gradient reduce-scatter: none | int8
    hpz: bool = False  # ZeRO-3: a secondary weight partition inside the node for the backward all-gather
    # compress.hierarchical: plain data parallelism's sums reduced in the node, all-reduced among one leader per
    # node, broadcast back (comm/hierarchical.py; planner/comm.py hierarchical_all_reduce)
    hierarchical: bool = False
    act_offload: tuple[int, ...] = ()  # remat.offload=cpu: global indices of the blocks whose saves go to the host
    # context parallelism (docs/context.md, Layout.cp): each sequence split over cp ranks (zigzag), parameters
    # replicated over cp; the attention of `cp_method` (planner/context_comm.py METHODS) brings the other ranks' keys
    cp_method: str = "ring"

    def __str__(self) -> str:
        return self.label()

    def local_seq(self, w: "Workload") -> int:
        """Tokens of one sequence on a rank: the whole sequence, or its 1/cp zigzag part."""
        return w.seq_len // self.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank, as the schedule's registration says (schedules/registry.py):
        the virtual stages of an interleaved pipeline, two for the V schedules, else 1."""
        return 1 if self.pp == 1 else _schedule_facts(self.schedule, self.virtual_stages)[0]

    @property
    def virtual(self) -> int:
        """`virtual_stages` as the schedule takes them: its own for a schedule that needs them
        (the registration's `needs_virtual_stages`: interleaved), else 1."""
        return self.virtual_stages if _schedule_facts(self.schedule, self.virtual_stages)[1] else 1

    @property
    def schedule_label(self) -> str:
        """The schedule's name, with xV when it takes virtual stages ("interleavedx2")."""
        from ..schedules.registry import SCHEDULES
        return self.schedule + (f"x{self.virtual_stages}" if SCHEDULES[self.schedule].needs_virtual_stages else "")

    @property
    def placement(self) -> str:
        """Which rank holds which stage: "interleaved" (stage s on rank s % pp) or "v"."""
        return "interleaved" if self.pp == 1 else _schedule_facts(self.schedule, self.virtual_stages)[2]

    def micro_batch_size(self, w: Workload) -> int:
        return w.global_batch // (self.dp * self.microbatches)

    def label(self) -> str:
        parts = [Layout.__str__(self), *([f"cp_method={self.cp_method}"] if self.cp > 1 else []),
                 f"zero={self.zero}", f"m={self.microbatches}", f"ckpt={self.remat}"]
        if self.pp > 1:
            parts.append(self.schedule_label)
        if self.sequence_parallel:
            parts.append("sp")
        if self.sync_every > 1:
            parts.append(f"H={self.sync_every}" + (" diloco" if self.outer == "nesterov" else ""))
        if self.weight_comm != "none" or self.grad_comm != "none":
            parts.append(f"qw={self.weight_comm} qg={self.grad_comm}")
        if self.hpz:
            parts.append("hpz")
        return " ".join(parts)


def hf_llama_model(config) -> ModelConfig:
    """The shapes of a transformers LlamaConfig as a ModelConfig (read off its attributes)."""
    return ModelConfig(preset="hf-llama", layers=config.num_hidden_layers, hidden=config.hidden_size,
                       heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                       ffn_hidden=config.intermediate_size, vocab=config.vocab_size,
                       max_seq=config.max_position_embeddings, mlp="swiglu", norm="rmsnorm", position="rope",
                       tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)), bias=False)


def from_config(cfg: Config, world_size: int, device_type: str = "cuda") -> tuple[Workload, Strategy]:
    """The workload and strategy of a threefold run with this config on `world_size` processes of
    `device_type` (which settles `precision.compute=auto`: bf16 on CUDA, fp32 on the CPU)."""
    cfg = cfg.for_device(device_type).validate(world_size)
    p = cfg.parallel
    strategy = Strategy.of(p, zero=p.zero, microbatches=cfg.train.microbatches,
                           remat=cfg.remat.policy, schedule=cfg.pipeline.schedule,
                           virtual_stages=cfg.pipeline.virtual_stages, sequence_parallel=p.sequence_parallel,
                           precision=cfg.precision.compute, remat_every=cfg.remat.every, bucket_mb=p.bucket_mb,
                           sync_every=cfg.train.sync_every, outer=cfg.train.outer_optimizer,
                           weight_comm=p.zero_weight_comm, grad_comm=p.zero_grad_comm, hpz=p.zero_hpz,
                           hierarchical=cfg.compress.hierarchical,
                           act_offload=cfg.remat.offloaded(cfg.model.layers), cp_method=p.cp_method)
    return Workload(cfg.model, cfg.train.global_batch, cfg.train.seq_len, optimizer=cfg.train.optimizer), strategy


# ------------------------------------------------------------------ parameter counts


@dataclass(frozen=True)
class ParamCount:
    """Parameters one rank holds: `total` of them, `frozen` not trained (no grads/optimizer), `expert`
    of them routed-expert weights (sharded over ep, reduced and ZeRO-sharded over edp = dp / ep)."""

    total: float
    frozen: float = 0.0
    expert: float = 0.0

    @property
    def trainable(self) -> float:
        return self.total - self.frozen

    def __add__(self, other: "ParamCount") -> "ParamCount":
        return ParamCount(self.total + other.total, self.frozen + other.frozen, self.expert + other.expert)


def _norm_params(m: ModelConfig) -> int:
    return m.hidden * (2 if m.norm == "layernorm" and m.bias else 1)


def layer_parameters(m: ModelConfig, tp: int = 1) -> ParamCount:
    """One transformer block: column-parallel q/k/v/gate/up and row-parallel o/down split over tp;
    norms and row-parallel biases replicated. The GPT key bias is frozen (decoder.py)."""
    h, kv, aw = m.hidden, m.kv_heads * m.head_dim, m.attn_width
    b = 1 if m.bias else 0
    column = h * (aw + 2 * kv) + b * (aw + 2 * kv)  # q, k, v
    row = aw * h  # o
    replicated = b * h + 2 * _norm_params(m)
    mats = 3 if m.mlp == "swiglu" else 2
    column += (mats - 1) * h * m.ffn_hidden + b * (mats - 1) * m.ffn_hidden  # gate, up
    row += m.ffn_hidden * h  # down
    replicated += b * h
    base = column / tp + row / tp + replicated
    if m.lora_rank:  # everything frozen; the adapters trained
        return ParamCount(base + lora_layer_parameters(m, tp), frozen=base)
    return ParamCount(base, frozen=b * kv / tp)


def lora_layer_parameters(m: ModelConfig, tp: int = 1) -> float:
    """One block's LoRA adapters on one tp rank (parallel/lora.py): r (in + out) per target projection,
    split as its base - a column-parallel base's A whole and B's rows split, a row-parallel base's A
    columns split and B whole (replicated grouped key/value heads: both whole)."""
    h, kv, aw, r, f = m.hidden, m.kv_heads * m.head_dim, m.attn_width, m.lora_rank, m.ffn_hidden
    kv_split = tp if m.kv_heads % tp == 0 else 1
    shapes = {"q_proj": r * h + r * aw / tp, "k_proj": r * h + r * kv / kv_split, "v_proj": r * h + r * kv / kv_split,
              "o_proj": r * aw / tp + r * h, "gate_proj": r * h + r * f / tp, "up_proj": r * h + r * f / tp,
              "down_proj": r * f / tp + r * h}
    return sum(n for name, n in shapes.items() if name in m.lora_target_names)


def embedding_parameters(m: ModelConfig, tp: int = 1) -> ParamCount:
    pos = m.max_seq * m.hidden if m.position == "learned" else 0
    total = -(-m.padded_vocab // tp) * m.hidden + pos  # rows padded to a multiple of tp
    return ParamCount(total, frozen=total if m.lora_rank else 0)


def head_parameters(m: ModelConfig, tp: int = 1, with_embedding: bool = True) -> ParamCount:
    """Final norm and output projection; a tied head is shared with the embedding on one stage."""
    head = 0 if (m.tie_embeddings and with_embedding) else -(-m.padded_vocab // tp) * m.hidden
    return ParamCount(_norm_params(m) + head, frozen=_norm_params(m) + head if m.lora_rank else 0)


def total_parameters(m: ModelConfig) -> int:
    """The whole model's parameter count (tied weights once), equal to count_parameters(m); a
    mixture of experts' sparse blocks hold their router and experts in place of the dense MLP."""
    dense = m.layers * layer_parameters(m).total + embedding_parameters(m).total + head_parameters(m).total
    return int(dense + sparse_blocks(m) * sparse_block_extra(m))


def active_parameters(m: ModelConfig) -> int:
    """Parameters one token's forward uses: the total less the routed experts it is not sent to."""
    idle = max(m.experts - m.experts_top_k, 0) * expert_parameters(m)
    return total_parameters(m) - sparse_blocks(m) * idle


@dataclass(frozen=True)
class Chunk:
    """One pipeline stage: its blocks (global indices) and whether it holds the embedding / head."""

    layers: range
    first: bool
    last: bool


@lru_cache(maxsize=1024)
def stage_ranges(m: ModelConfig, stages: int) -> tuple[range, ...]:
    """The blocks of each of `stages` pipeline stages, split as the runtime splits them by default
    (pipeline.stage.balance over parameter counts, the embedding on the first stage, the final norm and
    the head - counted even when tied - on the last)."""
    if stages == 1:
        return (range(m.layers),)
    layer = float(layer_parameters(m).total)
    first, last = float(embedding_parameters(m).total), float(_norm_params(m) + m.padded_vocab * m.hidden)
    bounds = balance_uniform(m.layers, stages, layer, first, last)
    ends = list(bounds[1:]) + [m.layers]
    return tuple(range(a, b) for a, b in zip(bounds, ends))


def balance_uniform(layers: int, stages: int, cost: float, first: float, last: float) -> list[int]:
    """pipeline.stage.balance for equal layer costs, the same programme and tie-break (the largest
    cut among equal values) with each stage's row vectorised: O(S L) array operations."""
    import numpy as np

    L, S = layers, stages
    extra = [(first if k == 0 else 0.0) + (last if k == S - 1 else 0.0) for k in range(S)]
    best = np.full((S, L + 1), np.inf)
    cut = np.zeros((S, L + 1), dtype=np.int64)
    best[0, 1:] = np.arange(1, L + 1) * cost + extra[0]
    i, j = np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]
    for k in range(1, S):  # every end i at once: values[i, j] for the cuts k <= j < i, the rest inf
        values = np.where((j >= k) & (j < i), np.maximum(best[k - 1][None, :], (i - j) * cost + extra[k]), np.inf)
        low = values.min(axis=1)
        last = L - np.argmax((values == low[:, None])[:, ::-1], axis=1)  # the largest cut among equal values
        best[k, k + 1:], cut[k, k + 1:] = low[k + 1:], last[k + 1:]
    bounds, end = [], L
    for k in range(S - 1, 0, -1):
        end = int(cut[k, end])
        bounds.append(end)
    return [0] + bounds[::-1]


@lru_cache(maxsize=65536)
def rank_chunks(m: ModelConfig, pp: int, rank: int, v: int = 1, placement: str = "interleaved") -> list[Chunk]:
    """The stages pipeline rank `rank` holds: stage c * pp + rank for each of its v chunks, or under the
    V placement (zb-v, dualpipev) stages rank and 2 pp - 1 - rank."""
    ranges = stage_ranges(m, pp * v)
    last = pp * v - 1
    stages = [rank, 2 * pp - 1 - rank] if placement == "v" else [c * pp + rank for c in range(v)]
    return [Chunk(ranges[s], s == 0, s == last) for s in stages]


@lru_cache(maxsize=65536)
def stage_layers(m: ModelConfig, pp: int, v: int = 1, placement: str = "interleaved") -> tuple[int, ...]:
    """Blocks held by each pipeline rank (all its chunks)."""
    return tuple(sum(len(c.layers) for c in rank_chunks(m, pp, r, v, placement)) for r in range(pp))


@lru_cache(maxsize=65536)
def rank_parameters(m: ModelConfig, tp: int, pp: int, stage: int, v: int = 1, ep: int = 1,
                    placement: str = "interleaved") -> ParamCount:
    """Parameters held by pipeline rank `stage` (tp shards of every matrix; a sparse block's router,
    shared experts and its experts / ep whole on every tp rank, as parallel/expert.py places them)."""
    chunks = rank_chunks(m, pp, stage, v, placement)
    layers = sum(len(c.layers) for c in chunks)
    sparse = sum(m.is_moe_block(i) for c in chunks for i in c.layers)
    count = ParamCount(layers * layer_parameters(m, tp).total, layers * layer_parameters(m, tp).frozen)
    if sparse:
        extra, expert = sparse_block_rank_extra(m, tp, ep)
        count = count + ParamCount(sparse * extra, 0.0, sparse * expert)
    if any(c.first for c in chunks):
        count = count + embedding_parameters(m, tp)
    if any(c.last for c in chunks):
        count = count + head_parameters(m, tp, with_embedding=pp == 1)
    return count


def with_model(w: Workload, **changes) -> Workload:
    return replace(w, model=replace(w.model, **changes))
