"""FLOPs of a training step of the reference decoder, and model FLOPs utilisation (MFU).

Counted per token, one multiply-add = 2 FLOPs, as in Narayanan et al. 2021 (appendix) and the
PaLM paper's MFU: a block's forward does 2 x (its weight-matrix parameters) FLOPs plus 4*s*h for
attention (q.k^T and the weighted sum over all s keys; the causal half is not discounted, the
usual convention). The output projection adds 2*h*V. Backward costs twice the forward.
Recomputation adds the forward of what is checkpointed: every block (`full`), one block in k
(`every-k`) or the attention core's 4*s*h (`selective`). MFU counts model FLOPs only
(3 x forward); "hardware" FLOPs include recomputation (Megatron-LM's reported TFLOP/s do).
Time is another matter: a fused causal kernel (flash attention, what SDPA runs on a GPU) skips the
masked half of the scores, so the step time charges `executed_attention_share` (1/2) of the
attention FLOPs under `Workload.attention = "flash"` and all of them under "dense".
For GPT-3 175B this reproduces Narayanan et al.'s 96*B*s*l*h^2*(1 + s/6h + V/16lh) exactly
when recomputation is full.
"""

from __future__ import annotations

import math
from functools import lru_cache

from ..config import ModelConfig
from ..models.loss_pieces import loss_bytes_per_logit as whole_loss_bytes_per_logit
from .activations import software_policy
from .hardware import Gpu
from .kernel_data import BACKWARD_FLOPS, attention_tflops
from .moe import dense_mlp_flops_per_token, sparse_blocks, sparse_mlp_flops_per_token
from .workload import Strategy, Workload


def block_matmul_params(m: ModelConfig) -> int:
    """Weights of one block's matrix multiplications (biases and norms do no matmul)."""
    kv = m.kv_heads * m.head_dim
    attn = 2 * m.hidden * m.attn_width + 2 * m.hidden * kv
    return attn + (3 if m.mlp == "swiglu" else 2) * m.hidden * m.ffn_hidden


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    return 4 * seq_len * m.hidden


def executed_attention_share(attention: str) -> float:
    """The share of the counted attention FLOPs the kernel executes: a causal flash kernel skips
    the blocks above the diagonal (half, for long sequences); a dense one computes them all."""
    return 0.5 if attention == "flash" else 1.0


def block_forward_flops_per_token(m: ModelConfig, seq_len: int, attention_share: float = 1.0,
                                  sparse: bool = False) -> float:
    """A block's forward per token; a sparse block's MLP is its router, kept experts and shared experts."""
    flops = 2 * block_matmul_params(m) + attention_share * attention_flops_per_token(m, seq_len)
    return flops + (sparse_mlp_flops_per_token(m, seq_len) - dense_mlp_flops_per_token(m) if sparse else 0.0)


def blocks_forward_flops_per_token(m: ModelConfig, seq_len: int, layers: int, sparse: int = 0,
                                   attention_share: float = 1.0) -> float:
    """`layers` blocks of which `sparse` are mixtures of experts."""
    return ((layers - sparse) * block_forward_flops_per_token(m, seq_len, attention_share)
            + sparse * block_forward_flops_per_token(m, seq_len, attention_share, True))


def head_forward_flops_per_token(m: ModelConfig) -> float:
    return 2 * m.hidden * m.padded_vocab  # the padded vocabulary (model.vocab_multiple): the matmul computes it


def recomputed_forward_flops_per_token(m: ModelConfig, seq_len: int, policy: str, layers: int, every: int = 2,
                                       attention_share: float = 1.0, sparse: int = 0) -> float:
    """Forward work redone in backward; `sparse` of the `layers` blocks are mixtures of experts (every-k
    redoes their average block)."""
    whole = blocks_forward_flops_per_token(m, seq_len, layers, sparse, attention_share)
    if policy == "full":
        return whole
    if policy == "every-k":
        return math.ceil(layers / max(1, every)) * whole / max(1, layers)
    if policy == "selective":
        return layers * attention_share * attention_flops_per_token(m, seq_len)
    if policy in ("op", "op-fp8"):  # torchtitan's op-level selective (activations.op_sac_items)
        return layers * op_sac_recomputed_flops_per_token(m, policy == "op-fp8")
    return 0.0


def op_sac_recomputed_flops_per_token(m: ModelConfig, fp8: bool) -> float:
    """The matmuls torchtitan's op-level selective checkpointing redoes in a block's backward: every second
    aten.mm in call order (wk, wo, w3 of wq, wk, wv, wo, w1, w3, w2), or every linear under Float8, whose
    _scaled_mm it does not keep. The attention kernel's output is kept: not redone."""
    h, d, f = m.hidden, m.head_dim, m.ffn_hidden
    mms = [h * m.heads * d, h * m.kv_heads * d, h * m.kv_heads * d, m.heads * d * h]
    mms += [h * f, h * f, f * h] if m.mlp == "swiglu" else [h * f, f * h]
    return 2.0 * sum(mms if fp8 else mms[1::2])


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward + backward of the whole model, no recomputation."""
    return 3 * (blocks_forward_flops_per_token(m, seq_len, m.layers, sparse_blocks(m)) + head_forward_flops_per_token(m))


def step_flops(w: Workload, st: Strategy, hardware: bool = True) -> float:
    """FLOPs of one optimizer step over all GPUs (with recomputation when `hardware`)."""
    per_token = model_flops_per_token(w.model, w.seq_len)
    if hardware:
        policy = software_policy(st.remat, w.selective, st.precision)
        per_token += recomputed_forward_flops_per_token(w.model, w.seq_len, policy, w.model.layers, st.remat_every,
                                                        sparse=sparse_blocks(w.model))
    return per_token * w.tokens


def mfu(w: Workload, step_time_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second over the cluster's dense peak."""
    return step_flops(w, Strategy(), hardware=False) / (step_time_s * gpus * peak_flops)


# ------------------------------------------------------------------ time: matmul shapes
#
# How fast a layer's matrix multiplications run depends on their shapes, not on one share of the peak
# per GPU (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, 2023):
#   * a GEMM (M x K) @ (K x N) does 2MNK FLOPs and moves at least (MK + KN + MN) elements; below the
#     arithmetic intensity peak / HBM bandwidth it is memory-bound (the roofline);
#   * its output is cut into tiles, one per multiprocessor at a time: a dimension that is not a multiple
#     of the tile computes padding (tile quantization), and tiles that do not fill the last wave of
#     `Gpu.sms` multiprocessors leave some idle (wave quantization). cuBLAS picks the tile per shape:
#     the largest (256 x 128) reuses data best, smaller ones trade per-tile throughput for fewer idle
#     multiprocessors; the model takes the best of four with relative throughputs 1, 0.9, 0.8, 0.6
#     (assumed, in the guide's order of efficiency);
#   * a large, well-shaped GEMM reaches `Gpu.gemm_efficiency` of the dense peak (measured cuBLAS
#     plateaus, hardware.py), and every GEMM costs `Gpu.gemm_fixed_s` more (launch, prologue and epilogue:
#     what a published per-shape table shows beyond the tiles and waves, planner/kernel_data.py).
# The elementwise work between the GEMMs (norms, residual adds, the MLP activation, rotary positions,
# a dense softmax) is memory-bound: its bytes over the HBM bandwidth. A fused causal (flash) attention
# kernel runs, forward and backward, at the TFLOP/s a published benchmark of that kernel measured at the
# sequence (`Gpu.attention_table`, kernel_data.py), else at `Gpu.attention_efficiency` of the peak on the
# FLOPs it executes. Everything is divided by `Gpu.compute_efficiency`, the one fitted share (hardware.py).

TILES = ((256, 128, 1.0), (128, 128, 0.9), (128, 64, 0.8), (64, 64, 0.6))  # (rows, columns, relative rate)


def _ceil(a: float, b: float) -> int:
    return -(-int(a) // int(b))


def quantization_efficiency(m: int, n: int, sms: int, batch: int = 1) -> float:
    """Share of the multiprocessors' time doing useful work for an m x n output (`batch` of them),
    the best over the tile shapes of TILES."""
    best = 0.0
    for tm, tn, rate in TILES:
        for rows, cols in ((tm, tn), (tn, tm)):
            tiles = _ceil(m, rows) * _ceil(n, cols) * batch
            waves = _ceil(tiles, sms)
            useful = (m * n * batch) / (tiles * rows * cols) * tiles / (waves * sms)
            best = max(best, rate * useful)
    return best


def gemm_seconds(m: int, n: int, k: int, gpu: Gpu, precision: str = "bf16", batch: int = 1) -> float:
    """Seconds of `batch` GEMMs (m x k) @ (k x n) on one GPU: the slower of compute (at the shape's share
    of the peak) and the memory roofline."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    compute = flops / (gpu.flops(precision) * gpu.gemm_efficiency * quantization_efficiency(m, n, gpu.sms, batch))
    memory = compute_element_bytes(precision) * (m * k + k * n + m * n) * batch / gpu.hbm_bytes_per_s
    return max(compute, memory) + gpu.gemm_fixed_s


def compute_element_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2  # fp8 keeps bf16 activations: only its GEMM operands are 1 byte


# ---- fp8 linears (precision.compute=fp8, parallel/fp8.py): the auto rule and the planner share this model
# Casting an operand for its two GEMMs (bytes moved per element): tensorwise reads it for the amax and
# for the cast and writes the fp8 copy in both layouts _scaled_mm needs (2 + 2 + 1 + 1); rowwise scales
# each layout over another dimension, so both reads happen per layout (2 x (2 + 2 + 1)).
FP8_CAST_BYTES = {"tensorwise": 6, "rowwise": 10}
# kernels per linear for the casts (amax, scale, cast of 3 operands, per layout for rowwise): each costs at
# least the launch gap `Gpu.op_overhead_s`, which is what keeps small GEMMs in bf16
FP8_CAST_KERNELS = {"tensorwise": 9, "rowwise": 18}
# share of the fp8 peak the scaled GEMM reaches relative to cuBLAS bf16 at the same shape: 1 for the
# tensorwise cuBLAS kernel; the rowwise (CUTLASS) kernel is assumed 10% slower
FP8_GEMM_SHARE = {"tensorwise": 1.0, "rowwise": 0.9}


def bf16_linear_seconds(m: int, k: int, n: int, gpu: Gpu) -> float:
    """Forward + backward GEMMs of a linear (x[m,k] W^T[k,n]) in bf16: output, input gradient, weight gradient."""
    return gemm_seconds(m, n, k, gpu) + gemm_seconds(m, k, n, gpu) + gemm_seconds(k, n, m, gpu)


def _fp8_gemm_seconds(m: int, n: int, k: int, gpu: Gpu, recipe: str) -> float:
    flops = 2.0 * m * n * k
    peak = gpu.fp8_flops * gpu.gemm_efficiency * FP8_GEMM_SHARE[recipe] * quantization_efficiency(m, n, gpu.sms)
    memory = (m * k + k * n + 2 * m * n) / gpu.hbm_bytes_per_s  # 1-byte operands, bf16 output
    return max(flops / peak, memory) + gpu.gemm_fixed_s


def fp8_linear_seconds(m: int, k: int, n: int, gpu: Gpu, recipe: str = "tensorwise") -> float:
    """The same three GEMMs with fp8 operands plus the dynamic casts (their HBM traffic and kernel launches);
    infinite on a GPU without fp8 tensor cores."""
    if not gpu.fp8_flops:
        return math.inf
    gemms = _fp8_gemm_seconds(m, n, k, gpu, recipe) + _fp8_gemm_seconds(m, k, n, gpu, recipe) \
        + _fp8_gemm_seconds(k, n, m, gpu, recipe)
    casts = FP8_CAST_BYTES[recipe] * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s
    return gemms + casts + FP8_CAST_KERNELS[recipe] * gpu.op_overhead_s


def fp8_gains(m: int, k: int, n: int, gpu: Gpu, recipe: str = "tensorwise") -> bool:
    """The auto rule of `precision.fp8_linears`: does the linear of GEMM shape (M=m tokens, K=k, N=n) train
    faster in fp8 than in bf16 on `gpu`?"""
    return fp8_linear_seconds(m, k, n, gpu, recipe) < bf16_linear_seconds(m, k, n, gpu)


def fp8_speedup(m: int, k: int, n: int, gpu: Gpu, recipe: str = "tensorwise") -> float:
    """bf16 / fp8 time of a linear's forward + backward (0 without fp8 tensor cores)."""
    fp8 = fp8_linear_seconds(m, k, n, gpu, recipe)
    return 0.0 if math.isinf(fp8) else bf16_linear_seconds(m, k, n, gpu) / fp8


def _linear_seconds(m: int, k: int, n: int, gpu: Gpu, precision: str) -> float:
    """One linear's forward GEMM time as the step model charges it (backward = twice forward): under fp8 a
    third of the faster of its bf16 and fp8 forward + backward (the auto rule keeps the slower in bf16)."""
    if precision != "fp8":
        return gemm_seconds(m, n, k, gpu, precision)
    return min(bf16_linear_seconds(m, k, n, gpu), fp8_linear_seconds(m, k, n, gpu)) / 3


def block_linear_shapes(m: ModelConfig, rows: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of one block's linears on a tp rank (q/k/v fused, as the step model counts them)."""
    h, f = m.hidden, m.ffn_hidden
    kv = m.kv_heads * m.head_dim
    q_width = _ceil(m.attn_width, tp)
    up = (2 if m.mlp == "swiglu" else 1) * _ceil(f, tp)
    return {"qkv": (rows, h, q_width + 2 * _ceil(kv, tp)), "attn_out": (rows, q_width, h),
            "mlp_up": (rows, h, up), "mlp_down": (rows, _ceil(f, tp), h)}


def executed_attention_flops(m: ModelConfig, rows: int, seq_len: int, tp: int, attention: str) -> float:
    """FLOPs an attention forward executes for `rows` query tokens of a tp rank against `seq_len` keys:
    q.k^T and the weighted sum, the share of them its kernel computes (`executed_attention_share`)."""
    return executed_attention_share(attention) * 4.0 * seq_len * m.attn_width * rows / tp


def attention_seconds(m: ModelConfig, rows: int, seq_len: int, tp: int, attention: str, gpu: Gpu,
                      precision: str) -> tuple[float, float]:
    """(forward, backward) kernel seconds of a fused (flash) attention for `rows` query tokens of a tp rank
    against `seq_len` keys; `compute_efficiency` not applied. With a published table (`Gpu.attention_table`,
    planner/kernel_data.py) each pass runs at its measured TFLOP/s at this sequence, the backward's FLOPs 2.5x
    the forward's; without one (or in fp32) at `Gpu.attention_efficiency` of the peak, the backward twice the
    forward's time."""
    flops = executed_attention_flops(m, rows, seq_len, tp, attention)
    if gpu.attention_table and precision != "fp32":
        forward, backward = attention_tflops(gpu.attention_table, seq_len)
        return flops / (forward * 1e12), BACKWARD_FLOPS * flops / (backward * 1e12)
    forward = flops / (gpu.flops(precision) * gpu.attention_efficiency)
    return forward, 2 * forward


def fused_attention_seconds(m: ModelConfig, rows: int, seq_len: int, tp: int, attention: str, gpu: Gpu,
                            precision: str) -> float:
    """The attention's seconds as the step model charges a block's forward (its backward then costs twice
    this): a third of `attention_seconds`' forward + backward, so the pair costs what the kernels take."""
    forward, backward = attention_seconds(m, rows, seq_len, tp, attention, gpu, precision)
    return (forward + backward) / 3


@lru_cache(maxsize=8192)
def block_forward_seconds(m: ModelConfig, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                          attention: str, gpu: Gpu, precision: str, cp: int = 1,
                          elementwise: str = "fused") -> tuple[float, float]:
    """(seconds, FLOPs) of one dense block's forward of a micro-batch on one tp rank, from the shapes of
    its matmuls: q/k/v and the attention output (column / row parallel, 1/tp of the width), the MLP's
    up (and gate) and down, the attention scores and weighted sum per head; plus its memory-bound
    elementwise work (`elementwise_bytes_per_token`, by the software's kernels). Under context parallelism
    (`cp` > 1) the rank holds seq_len / cp tokens of each sequence, whose queries attend to keys of the whole
    sequence: 1/cp of the causal work (the zigzag split balances it)."""
    rows = micro_batch * seq_len // cp  # tokens of the micro-batch on this rank: the GEMMs' M
    t = 0.0
    # q, k, v (one fused weight), attention output (row parallel), MLP up (and gate), MLP down
    for mm, k, n in block_linear_shapes(m, rows, tp).values():
        t += _linear_seconds(mm, k, n, gpu, precision)
    precision = "bf16" if precision == "fp8" else precision  # the rest of the block stays bf16
    heads = micro_batch * _ceil(m.heads, tp)
    attn_flops = executed_attention_flops(m, rows, seq_len, tp, attention)
    el = compute_element_bytes(precision)
    if attention == "flash":
        t += fused_attention_seconds(m, rows, seq_len, tp, attention, gpu, precision)
    else:  # the s x s scores go through memory: two batched GEMMs and the softmax (+ its dropout) between
        local = seq_len // cp  # the rank's queries against every key
        t += gemm_seconds(local, seq_len, m.head_dim, gpu, precision, heads)
        t += gemm_seconds(local, m.head_dim, seq_len, gpu, precision, heads)
        t += 4 * el * heads * local * seq_len / gpu.hbm_bytes_per_s
    forward, backward = elementwise_bytes_per_token(m, tp, sequence_parallel, elementwise, el)
    t += rows * (forward + backward) / 3 / gpu.hbm_bytes_per_s  # the pair costs what the passes move
    flops = rows * (2 * block_matmul_params(m) / tp) + attn_flops
    return t / gpu.compute_efficiency, flops


def elementwise_bytes_per_token(m: ModelConfig, tp: int, sequence_parallel: bool, kind: str = "fused",
                                el: int = 2) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of a block's memory-bound work between its GEMMs and attention kernel
    on a tp rank (widths of q, k/v and the MLP over tp; of the hidden size over tp only under sequence parallelism).

    "fused": read + write once per element and operation, `el` bytes each: 2 norms (2h), 2 residual adds (3h), the
    activation (GELU 2f, SwiGLU 3f) and rotary q and k (2 x their widths); the backward twice the forward's bytes.
    "torchtitan-eager": torchtitan's Llama block run eager in bf16, as counted kernel by kernel
    (tests/unit/test_plan_elementwise.py: every aten operation of a forward and backward recorded on the CPU, each
    priced at the bytes its GPU kernel reads and writes). Per element of h, forward: its RMSNorm of fp32 steps (cast
    up 6, square 8, mean 4, scale 8, cast down 6, weight 4: 36) twice and the residual adds (6) twice, 84; backward
    84 per norm, 8 per norm weight's gradient, and 6 per sum of two gradients (the two residual branches; q, k, v's
    and w1, w3's input gradients: 5 sums), 214. Rotary positions through complex fp32 (cast up 6, complex product 8,
    cast down 6): 20 per element of q and k, forward and backward. The k and v heads repeated to the query heads
    (expand then a copy where 1 < kv heads < heads): 4 (q + kv) forward; their gradients summed back: 4 (q + kv)
    where kv heads < heads. SiLU then the product: 10 per element of the MLP width forward, 18 backward."""
    h, f, kv, q = m.hidden, m.ffn_hidden, m.kv_heads * m.head_dim, m.attn_width
    hidden_share = 1 / (tp if sequence_parallel else 1)
    if kind == "fused":
        sharded = (3 if m.mlp == "swiglu" else 2) * f + (2 * (q + kv) if m.position == "rope" else 0)
        forward = el * (sharded / tp + 10 * h * hidden_share)
        return forward, 2 * forward
    if kind != "torchtitan-eager":
        raise ValueError(f"elementwise_bytes_per_token: unknown kind '{kind}'")
    qkv = (q + kv) / tp
    copied = 4 * qkv if 1 < m.kv_heads < m.heads else 0.0
    summed = 4 * qkv if m.kv_heads < m.heads else 0.0
    forward = 84 * h * hidden_share + 20 * qkv + copied + 10 * f / tp
    backward = 214 * h * hidden_share + 20 * qkv + summed + 18 * f / tp
    return forward, backward


@lru_cache(maxsize=4096)
def regather_cover_seconds(m: ModelConfig, micro_batch: int, seq_len: int, tp: int, attention: str, gpu: Gpu,
                           precision: str, cp: int = 1) -> dict[str, tuple[float, float]]:
    """Seconds of backward work that run while a sequence-parallel region's regather is in flight, for
    the attention and the MLP region, by where it is issued (`Workload.regather`):
      "region"    threefold (parallel/sequence_region.py SequenceRegion): at the region's backward start, under
                  its row-parallel linear's two gradient GEMMs, the attention's (or the activation's)
                  backward and the first consumer's input-gradient GEMM;
      "consumer"  threefold where the block's shard was not kept (a checkpointed or offloaded block: it
                  is recomputed or reloaded): by the first consumer, under its input-gradient GEMM alone
                  - the linear autograd reaches first, v (the last made of q, k, v) and up;
      "linear"    Megatron-LM: inside the fused q/k/v and first MLP linear's backward, under their
                  input-gradient GEMMs."""
    rows = micro_batch * seq_len // cp
    shapes = block_linear_shapes(m, rows, tp)
    precision = "bf16" if precision == "fp8" else precision
    e = gpu.compute_efficiency

    def input_grad(name: str, width: int | None = None) -> float:
        mm, k, n = shapes[name]
        return gemm_seconds(mm, k, width or n, gpu, precision) / e

    def both_grads(name: str) -> float:
        mm, k, n = shapes[name]
        return (gemm_seconds(mm, k, n, gpu, precision) + gemm_seconds(k, n, mm, gpu, precision)) / e

    up_width = _ceil(m.ffn_hidden, tp)
    consumer = (input_grad("qkv", _ceil(m.kv_heads * m.head_dim, tp)), input_grad("mlp_up", up_width))
    attention_backward = attention_seconds(m, rows, seq_len, tp, attention, gpu, precision)[1] / e
    activation_backward = compute_element_bytes(precision) * rows * (3 if m.mlp == "swiglu" else 2) * up_width \
        / gpu.hbm_bytes_per_s / e
    region = (both_grads("attn_out") + attention_backward + consumer[0],
              both_grads("mlp_down") + activation_backward + consumer[1])
    return {"region": region, "consumer": consumer, "linear": (input_grad("qkv"), input_grad("mlp_up"))}


@lru_cache(maxsize=4096)
def head_forward_seconds(m: ModelConfig, micro_batch: int, seq_len: int, tp: int, gpu: Gpu,
                         precision: str) -> float:
    """The output projection of one micro-batch on one tp rank (vocabulary-parallel: 1/tp of the rows);
    `seq_len`: the rank's tokens of a sequence."""
    rows = micro_batch * seq_len
    return gemm_seconds(rows, _ceil(m.padded_vocab, tp), m.hidden, gpu, precision) / gpu.compute_efficiency


# ---- the cross-entropy over the vocabulary: memory-bound passes over the logits, per software
# HBM bytes per logit of its forward and backward kernels on a GPU (eager), c = the logits' element size:
#   "threefold"  models/cross_entropy.py (tp = 1): models/loss_pieces.py `loss_bytes_per_logit` (the row max,
#                the upcast chunk, torch's fused softmax in place, softmax - one_hot in the logits' dtype; backward
#                scales it per row: bf16 30 + 4, fp32 20 + 8); parallel/tensor.py's vocabulary-parallel loss (tp > 1): amax
#                (c), an fp32 copy of each chunk (c + 4), subtract, exp in place, sum (8 + 8 + 4); backward
#                (both, softmax_minus_one_hot): an fp32 copy (c + 4), subtract, exp, scale in place
#                (8 + 8 + 8), written back in the logits' dtype (4 + c)
#   "megatron"   megatron/core/tensor_parallel/cross_entropy.py (2020-2024): .float() (c + 4), max (4),
#                subtract, exp and divide in place (8 + 8 + 8), sum (4); backward: scale in place (8) and
#                .float()'s backward cast (4 + c)
#   "torch"      F.cross_entropy(logits.float()) (torchtitan): the cast (c + 4), log_softmax's max, sum
#                and write passes (4 + 4 + 8); backward: nll's dense gradient (4), log_softmax's backward
#                (4 + 8 + 4), the cast back (4 + c)
# The gathers of the target's logit and the one-hot's scatter touch one logit per token: left out.


def loss_bytes_per_logit(kind: str, c: int, vocab_parallel: bool, padded: bool = False) -> tuple[int, int]:
    """(forward, backward) HBM bytes per logit of the cross-entropy `kind` computes (workload.LOSSES); a cast of
    fp32 logits to fp32 (`.float()`) moves nothing; `padded`: the vocabulary is padded (model.vocab_multiple)."""
    cast = 0 if c == 4 else c + 4
    if kind == "megatron":
        return cast + 4 + 8 + 8 + 4 + 8, 8 + cast
    if kind == "torch":
        return cast + 4 + 4 + 8, 4 + (4 + 8 + 4) + cast
    if not vocab_parallel:
        return whole_loss_bytes_per_logit(c, padded)
    return c + (c + 4) + 8 + 8 + 4, (c + 4) + 8 + 8 + 8 + (4 + c)


def loss_seconds(m: ModelConfig, micro_batch: int, seq_len: int, tp: int, gpu: Gpu, precision: str,
                 kind: str = "threefold") -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's cross-entropy on one tp rank: its logits
    (rows x padded vocabulary / tp) times `loss_bytes_per_logit` over the HBM bandwidth."""
    logits = micro_batch * seq_len * _ceil(m.padded_vocab, tp)
    forward, backward = loss_bytes_per_logit(kind, compute_element_bytes(precision), tp > 1,
                                             m.padded_vocab != m.vocab)
    rate = gpu.hbm_bytes_per_s * gpu.compute_efficiency
    return logits * forward / rate, logits * backward / rate
