"""Memory per rank: model states by ZeRO stage and precision, activations, buffers, margin.

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3: K = 12 bytes of optimizer state
per parameter under mixed precision): per parameter the rank holds
    params  2 bytes (bf16/fp16 compute copy)  or 4 (fp32 training)
    grads   2 bytes                           or 4
    optim  12 bytes (fp32 master, Adam m, v)  or 8 (Adam m, v; the fp32 params are the master)
ZeRO over N data-parallel ranks shards optim (stage >= 1), grads (>= 2) and params (3):
16P, 4P + 12P/N, 2P + 14P/N and 16P/N bytes under mixed precision. Frozen parameters (the
GPT key bias) have no gradient and no optimizer state.

Activations follow the accounting of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4): list every tensor autograd saves for
backward, by size. The list below is the one threefold's reference decoder really saves (read
off its saved-tensor hooks, which is what observe/memory.py `SavedTensorMeter` counts):
per block of a micro-batch of b sequences of s tokens, c bytes per compute element,
    norm (x2)   LayerNorm: input, output (c*bsh each) + mean, rstd (4*bs each)
                RMSNorm:   fp32 input, fp32 normalised, output (8+c)*bsh + rsqrt 4*bs
    attention   q, k, v as given to scaled_dot_product_attention (k, v expanded to all heads):
                3c*bsh; output c*bsh; log-sum-exp 4*b*heads*s; with RoPE the output is copied
                to (b, s, h) for the o projection (another c*bsh) and cos/sin tables (4*s*d)
    mlp         GELU: up output, GELU output (2c*bsf); SwiGLU: gate, silu, up, product (4c*bsf)
Unlike Megatron-LM in the paper, SDPA (flash) attention keeps no s x s score matrix and there is
no dropout, so the paper's 5as/h term is absent; `korthikanti_layer_bytes` gives the paper's
own formula for comparison. Tensor parallelism divides the attention and MLP items by tp;
sequence parallelism also divides the norm items. Checkpointing: `full` keeps only each block's
input (c*bsh), `selective` drops the attention core's internals (the log-sum-exp here, the s^2
terms in the paper), `every-k` applies `full` to one block in k.
Outside the blocks: the token indices (the int64 rows of this rank's whole batch, inputs and
targets share them), learned positions (8*s), the final norm and the fp32 log-probabilities of
the loss (4*bsV/tp) and its flattened int64 targets (8*bs, a copy when b > 1).

Micro-batches in flight: 1 without a pipeline (each backward frees its activations before the
next forward); the first stage holds min(pp, m) under 1F1B and ZB-H1, m under GPipe, and
pp * (1 + (pp-1)/(pp*v)) micro-batches' worth under the interleaved schedule (Korthikanti et
al. 2022, section 4.2.3).

On a GPU the peak also holds what the meter never sees: the working set of the block being
recomputed, the logits and their fp32 copy and gradient, communication buffers (gradient
buckets, ZeRO-3 gathered layers, pipeline send/recv), plus ALLOCATOR_MARGIN of fragmentation
and RESERVED_BYTES for the CUDA context, cuBLAS workspaces and NCCL. On the CPU (gloo runs)
none of these are added: the prediction is the counted bytes of the trainer's `mem` record.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..config import Config
from .hardware import CPU, GiB, Gpu
from .workload import ParamCount, Strategy, Workload, from_config, rank_parameters, stage_layers

ALLOCATOR_MARGIN = 0.10  # caching-allocator fragmentation, as a fraction of the bytes in use
RESERVED_BYTES = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL internal buffers


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, all micro-batches in flight
    transient: float = 0.0  # recomputed block, logits work space (GPU only)
    buffers: float = 0.0  # communication buffers (GPU only)
    margin: float = 0.0  # allocator margin + reserved (GPU only)
    stage: int = 0  # the pipeline stage whose rank needs the most

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.transient + self.buffers + self.margin

    def as_dict(self) -> dict:
        out = {k: int(round(v)) for k, v in asdict(self).items() if k != "stage"}
        out["total"] = int(round(self.total))
        out["peak"] = out["total"]
        return out


# ------------------------------------------------------------------ model states


def bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter before any ZeRO sharding."""
    return (4, 4, 8) if precision == "fp32" else (2, 2, 12)


def model_state_bytes(count: ParamCount, precision: str, zero: int, dp: int) -> tuple[float, float, float]:
    """Bytes of parameters, gradients and optimizer states on one rank (ZeRO over dp ranks)."""
    p_bytes, g_bytes, o_bytes = bytes_per_param(precision)
    trainable = count.trainable
    params = count.total * p_bytes / (dp if zero >= 3 else 1)
    grads = trainable * g_bytes / (dp if zero >= 2 else 1)
    optim = trainable * o_bytes / (dp if zero >= 1 else 1)
    return params, grads, optim


# ------------------------------------------------------------------ activations


def compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def norm_bytes(w: Workload, b: int, c: int) -> float:
    m, s = w.model, w.seq_len
    bs = b * s
    if m.norm == "rmsnorm":
        return (8 + c) * bs * m.hidden + 4 * bs
    return 2 * c * bs * m.hidden + 8 * bs


def block_activation_items(w: Workload, st: Strategy, b: int) -> dict[str, float]:
    """Bytes one block saves for backward for a micro-batch of b sequences, without checkpointing."""
    m, s, t = w.model, w.seq_len, st.tp
    c = compute_bytes(st.precision)
    bsh = b * s * m.hidden
    sp = t if st.sequence_parallel else 1
    rope = m.position == "rope"
    per_mlp = (4 if m.mlp == "swiglu" else 2) * c * b * s * m.ffn_hidden
    return {
        "norms": 2 * norm_bytes(w, b, c) / sp,
        "qkv": 3 * c * bsh / t,
        "attention_out": c * bsh / t * (2 if rope else 1),
        "attention_core": 4 * b * m.heads * s / t,  # log-sum-exp of flash attention
        "rope_tables": 4 * s * m.head_dim if rope else 0,
        "mlp": per_mlp / t,
    }


def block_bytes(w: Workload, st: Strategy, b: int, policy: str) -> float:
    """Bytes a block keeps until its backward under a checkpointing policy."""
    items = block_activation_items(w, st, b)
    if policy == "full":
        sp = st.tp if st.sequence_parallel else 1
        return compute_bytes(st.precision) * b * w.seq_len * w.model.hidden / sp  # the block's input
    if policy == "selective":
        items = {k: v for k, v in items.items() if k != "attention_core"}
    return sum(items.values())


def stage_block_bytes(w: Workload, st: Strategy, b: int, layers: int) -> float:
    if st.remat == "every-k":
        checkpointed = math.ceil(layers / max(1, st.remat_every))
        return checkpointed * block_bytes(w, st, b, "full") + (layers - checkpointed) * block_bytes(w, st, b, "none")
    return layers * block_bytes(w, st, b, st.remat)


def embedding_bytes(w: Workload, st: Strategy) -> float:
    """Token indices (this rank's whole batch of rows, shared by inputs and targets) and positions."""
    rows = w.global_batch // st.dp
    return rows * (w.seq_len + 1) * 8 + (8 * w.seq_len if w.model.position == "learned" else 0)


def head_bytes(w: Workload, st: Strategy, b: int) -> float:
    """Final norm, fp32 log-probabilities of the loss (vocab-parallel over tp), the flattened
    targets (a copy: they are a strided view of the rows, contiguous only for one row) and the
    loss's weight scalar."""
    c = compute_bytes(st.precision)
    sp = st.tp if st.sequence_parallel else 1
    targets = 8 * b * w.seq_len if b > 1 else 0
    return norm_bytes(w, b, c) / sp + 4 * b * w.seq_len * w.model.vocab / st.tp + targets + 4


def in_flight(st: Strategy, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak."""
    p, m = st.pp, st.microbatches
    if p == 1:
        return 1
    if st.schedule == "gpipe":
        return m
    held = min(p - stage, m)
    if st.schedule == "interleaved" and st.virtual_stages > 1:
        return held * (1 + (p - 1) / (p * st.virtual_stages))
    return held


# ------------------------------------------------------------------ the whole rank


def stage_memory(w: Workload, st: Strategy, stage: int, gpu: Gpu = CPU) -> MemoryBreakdown:
    count = rank_parameters(w.model, st.tp, st.pp, stage)
    params, grads, optim = model_state_bytes(count, st.precision, st.zero, st.dp)
    b = st.micro_batch_size(w)
    layers = stage_layers(w.model, st.pp)[stage]
    acts = in_flight(st, stage) * stage_block_bytes(w, st, b, layers)
    if stage == 0:
        acts += embedding_bytes(w, st)
    if stage == st.pp - 1:
        acts += in_flight(st, stage) * head_bytes(w, st, b)
    if gpu is CPU:
        return MemoryBreakdown(params, grads, optim, acts, stage=stage)
    c = compute_bytes(st.precision)
    transient = 0.0
    if st.remat in ("full", "every-k", "selective") and layers:
        transient += block_bytes(w, st, b, "none") - (block_bytes(w, st, b, "selective") if st.remat == "selective" else 0)
    if stage == st.pp - 1:
        transient += (c + 8) * b * w.seq_len * w.model.vocab / st.tp  # logits, fp32 copy, its gradient
    buffers = 0.0
    if st.dp > 1:
        buffers += 2 * st.bucket_mb * 2**20  # buckets in flight while the next ones fill
    if st.zero >= 3:
        per_layer = rank_parameters(w.model, st.tp, st.pp, stage).total / max(1, layers)
        buffers += 2 * per_layer * c * 2  # gathered layer in use + the one prefetched, with grads
    if st.pp > 1:
        sp = st.tp if st.sequence_parallel else 1
        buffers += 2 * c * b * w.seq_len * w.model.hidden / sp  # send and receive
    used = params + grads + optim + acts + transient + buffers
    return MemoryBreakdown(params, grads, optim, acts, transient, buffers, ALLOCATOR_MARGIN * used + RESERVED_BYTES,
                           stage=stage)


def rank_memory(w: Workload, st: Strategy, gpu: Gpu = CPU) -> MemoryBreakdown:
    """The breakdown of the rank that needs the most memory (first or last pipeline stage)."""
    stages = {0, st.pp - 1}
    return max((stage_memory(w, st, s, gpu) for s in stages), key=lambda mem: mem.total)


def predict_memory(cfg: Config, world_size: int, gpu: Gpu | None = None) -> dict:
    """Predicted bytes per rank for a threefold run of `cfg` on `world_size` processes.

    Keys as in metrics.jsonl `mem` (params, grads, optimizer, activations, peak) plus the
    planner's extras. On the CPU (`gpu=None`) the prediction is what the trainer counts: no
    allocator margin, no buffers, and the configured precision (fp32 by default).
    """
    w, st = from_config(cfg, world_size)
    return rank_memory(w, st, gpu or CPU).as_dict()


# ------------------------------------------------------------------ the paper's formula


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            policy: str = "none") -> float:
    """Activation bytes per transformer layer in Megatron-LM, Korthikanti et al. 2022, table 2
    (16-bit activations, 1-byte dropout masks, s x s attention scores kept)."""
    sbh = s * b * h
    if policy == "full":
        return 2 * sbh / (t if sp else 1)
    score = 0 if policy == "selective" else 5 * a * s / h
    if sp:
        return sbh * (34 + score) / t
    return sbh * (10 + 24 / t + score / t)
