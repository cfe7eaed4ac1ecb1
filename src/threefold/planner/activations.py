"""Bytes autograd saves for backward, item by item, for one micro-batch on one rank.

The accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): list every tensor saved for backward, by size. The lists here
are the ones the models really save - read off their saved-tensor hooks, which is what
observe/memory.py `SavedTensorMeter` counts (each storage once per forward) - for b sequences
of s tokens, c bytes per compute element (2 in bf16/fp16, 4 in fp32), t tensor-parallel ranks.

threefold's reference decoder, per block:
    norm (x2)   LayerNorm: input c*bsh, mean and rstd 2c*bs (the CPU kernel keeps them in the
                compute dtype; CUDA in fp32, a difference below 0.1%); RMSNorm (`nn.RMSNorm`, fp32
                inside; torch's composite on the CPU): fp32 input and normalised 8*bsh, rsqrt 4*bs
                (CUDA's fused kernel keeps less: the input and rsqrt).
                The norm output (c*bsh) is what the next linear layers save.
    attention   q, k, v as given to SDPA (k, v unexpanded: grouped heads) c*bs*d*(heads + 2 kv_heads)/t, output c*bsh/t,
                the flash log-sum-exp 4*b*heads*s/t; with RoPE the output is copied for the o
                projection (c*bsh/t); the cos/sin tables (4*s*d) are cached, one pair for all blocks
    mlp         GELU: up output, GELU output 2c*bsf/t; SwiGLU: gate, silu, up, product 4c*bsf/t
Sequence parallelism (tp > 1): the norms see s/t tokens; a region's column-parallel linears (q/k/v,
the MLP's up/gate, the head) save the 1/t sequence shard of their input once between them, not
the all-gathered (b*s, h) tensor, and their backward all-gathers it again (Megatron-LM's way,
Korthikanti et al. 2022 section 4.2.2; parallel/sequence_region.py `SequenceRegion`).
Outside the blocks: the token indices (without tp the int64 rows of the rank's whole batch,
shared by inputs and targets: a view, so the whole storage counts in every forward that
saves it; with tp the embedding's masked local ids 8*bs and mask bs), learned positions 8*s,
the final norm, the loss's softmax - one_hot in the compute dtype c*bsV (models/cross_entropy.py keeps it in
place of the logits, which are freed; vocabulary-parallel: the logits and an fp32 log-sum-exp 4*bs: the local slice c*bsV/t, log-sum-exp 4*bs, local
ids 8*bs, mask bs) and the flattened targets (8*bs, a copy unless one row). V is the padded
vocabulary (`model.vocab_multiple`), padded again to a multiple of t when tp does not divide it. With the loss in pieces (`model.loss_chunk` < bs, models/loss.py) the
head and loss are checkpointed: only the head's input (c*bsh, /t under SP) and the targets' rows
(views) are kept, nothing of vocabulary size.

Hugging Face Llama (`implementation="hf-llama"`, transformers' LlamaForCausalLM with SDPA):
the same items except that the attention output is
not copied for o_proj, the rotary tables are computed once per forward (2c*s*d), the
norm keeps its output and (16-bit) a 16-bit copy of the normalised tensor, the head's logits
are whole (gathered) before the library's fp32 loss, and the labels are shifted into a new
int64 tensor (8*bs).

Context parallelism (cp > 1, docs/context.md): s is the rank's 1/cp zigzag part of the sequence, and
every item above is per local token, so it is 1/cp of the whole sequence's - except what the method
keeps of other ranks: allgather's attention saves the all-gathered K and V (cp x the local ones)
and, as the ring, its fused blocks' output merged in fp32 (4*bsh/t) beside the o projection's input; ulysses' SDPA runs is_causal on whole sequences (no mask, models/attention.py)
and, without RoPE's copy, keeps its head-sharded output beside the o projection's input (c*bsh/t);
the ring's core saves its output in fp32 (4*bsh/t, its blocks are merged in fp32) beside the o
projection's input copy (c*bsh/t). The rotary tables come from the core's global positions
(`rotary_at`, not cached): each block computes and saves its own pair of the local s x d/2. The
token rows are split copies (inputs and targets, 8*bs each), not views of the rank's rows.

Checkpointing: `full` keeps each block's input (c*bsh, /t under SP); `selective` drops the
attention core's internals (the log-sum-exp here - and the core's output where RoPE's copy feeds
the o projection - the s^2 scores in the paper), keeping the core's inputs (the local q, k, v) and
the o projection's input (c*bsh/t); under cp the core is the method's whole attention, so its
gathered K and V, allgather's mask, ulysses' head-sharded output and the ring's fp32 output all go (the
recomputation in backward holds them again, one block at a time); `every-k`
applies `full` to the blocks whose global index is a multiple of k.

Activation offload (`remat.offload=cpu`, parallel/remat.py): an offloaded block's saves (under its
policy: all of them, its input under full / every-k's checkpointed blocks, what selective keeps)
move to host memory, each storage once per block - so the rotary tables, shared by every block,
are copied by each offloaded block that saves them, and stay on the device only if a block that
is neither offloaded nor checkpointed saves them too (`offload_split`).
"""

from __future__ import annotations

from functools import lru_cache

from dataclasses import dataclass

from ..config import ModelConfig
from ..models.loss_pieces import piece_tokens
from .moe import sparse_mlp_saved_bytes


@dataclass(frozen=True)
class Shape:
    """One micro-batch on one rank: b sequences of s tokens, c bytes per element, tp t."""

    b: int
    s: int  # tokens of a sequence on this rank (the whole sequence / cp)
    c: int
    t: int = 1
    sp: bool = False
    cp: int = 1  # context parallelism: the sequence is cp x s tokens, split over cp ranks
    cp_method: str = "ring"  # planner/context_comm.py METHODS (only read when cp > 1)

    @property
    def bs(self) -> int:
        return self.b * self.s


def padded(n: int, t: int) -> int:
    """A dimension split over t ranks, padded to a multiple of t (the vocabulary)."""
    return -(-n // t)


def norm_items(m: ModelConfig, x: Shape, hf: bool = False) -> float:
    """One norm's saved bytes, without its output (which the consumer saves)."""
    tokens = x.bs // x.t if x.sp else x.bs
    if m.norm == "layernorm":
        return x.c * tokens * m.hidden + 2 * x.c * tokens  # input, mean and rstd (compute dtype on the CPU)
    if hf:  # fp32 input, rsqrt, the normalised tensor in the compute dtype
        return (4 + x.c) * tokens * m.hidden + 4 * tokens
    return 8 * tokens * m.hidden + 4 * tokens  # nn.RMSNorm's composite: fp32 input and normalised, rsqrt


def linear_inputs(m: ModelConfig, x: Shape, consumers: int) -> float:
    """The input a norm hands to `consumers` column-parallel linears: saved once, shared by them; under
    SP its 1/t sequence shard (the linears' backward all-gathers it again, parallel/sequence_region.py SequenceRegion)."""
    whole = x.c * x.bs * m.hidden
    return whole / x.t if x.sp and x.t > 1 else whole


def block_items(m: ModelConfig, x: Shape, hf: bool = False) -> dict[str, float]:
    """Bytes one block saves for backward (no checkpointing)."""
    t, c, bs = x.t, x.c, x.bs
    heads, kv_heads = m.heads // t, max(1, m.kv_heads // t)
    d = m.head_dim
    rope = m.position == "rope"
    mlp_consumers = 2 if m.mlp == "swiglu" else 1
    kv = kv_heads  # both give SDPA k and v unexpanded (grouped heads)
    items = {
        "norms": 2 * norm_items(m, x, hf) + linear_inputs(m, x, 3) + linear_inputs(m, x, mlp_consumers),
        "qkv": c * bs * d * (heads + 2 * kv),
        "attention_out": c * bs * heads * d * (2 if (rope and not hf) else 1),
        "attention_core": 4 * x.b * heads * x.s,  # log-sum-exp of flash attention
        "mlp": (4 if m.mlp == "swiglu" else 2) * c * bs * padded(m.ffn_hidden, t),
    }
    if x.cp > 1 and x.cp_method == "allgather":  # the gathered K, V of the whole sequence; fused blocks merged
        items["qkv"] = c * bs * d * (heads + 2 * kv * x.cp)  # in fp32 as the ring's (models/attention.py)
        items["attention_out"] = c * bs * heads * d
        items["cp_core"] = 4 * bs * heads * d
    elif x.cp > 1 and x.cp_method == "ulysses":  # whole sequences of heads/cp heads, SDPA is_causal: no mask
        if not (rope and not hf):  # SDPA's head-sharded output beside the o projection's input
            items["attention_out"] += c * bs * heads * d
    elif x.cp > 1 and x.cp_method == "ring":  # the core's fp32 output; the o projection's input copy
        items["attention_out"] = c * bs * heads * d
        items["cp_core"] = 4 * bs * heads * d
    return items


def sparse_block_items(m: ModelConfig, x: Shape, ep: int = 1, hf: bool = False) -> dict[str, float]:
    """A sparse block (planner/moe.py): the dense block's items with the MLP replaced by the mixture
    of experts, which reads the norm's output once (the sequence-local shard under SP)."""
    items = block_items(m, x, hf)
    consumers = 2 if m.mlp == "swiglu" else 1
    items["norms"] += (x.c * x.bs * m.hidden / (x.t if x.sp and x.t > 1 else 1)
                       - linear_inputs(m, x, consumers))
    items["mlp"] = sparse_mlp_saved_bytes(m, x.b, x.s, x.c, x.t, x.sp, ep, x.cp)
    return items


def op_sac_items(m: ModelConfig, x: Shape, fp8: bool) -> dict[str, float]:
    """Bytes a Llama block keeps under torchtitan's op-level selective checkpointing (`selective_ac_option =
    'op'`, torchtitan/parallelisms/parallelize_llama.py `_save_list`, commit 9dec370): the checkpointed block's
    input, then only the outputs of aten.mm - every second one recomputed, counted per block in call order wq,
    wk, wv, wo, w1, w3, w2, so wq, wv, w1 and w2 are kept - and of the SDPA kernel (its output and fp32
    log-sum-exp); norms, RoPE, SiLU and products are recomputed. Under Float8 the linears run torch._scaled_mm,
    which is not in the list: none of their outputs is kept."""
    t, c, bs = x.t, x.c, x.bs
    heads, kv_heads = m.heads // t, max(1, m.kv_heads // t)
    items = {"input": c * bs * m.hidden / (t if x.sp and t > 1 else 1),
             "attention": c * bs * heads * m.head_dim + 4 * x.b * heads * x.s}
    if not fp8:  # wq's and wv's outputs, w1's (column-parallel: 1/t), w2's (its partial sum before the reduction)
        items["mm"] = c * bs * (m.head_dim * (heads + kv_heads) + padded(m.ffn_hidden, t) + m.hidden)
    return items


def software_policy(remat: str, selective: str, precision: str) -> str:
    """The policy `block_bytes` reads: the run's own, or torchtitan's op-level selective ("op", "op-fp8")."""
    if remat == "selective" and selective == "torchtitan-op":
        return "op-fp8" if precision == "fp8" else "op"
    return remat


@lru_cache(maxsize=65536)
def block_bytes(m: ModelConfig, x: Shape, policy: str, hf: bool = False, sparse: bool = False,
                ep: int = 1) -> float:
    """Bytes a block keeps until its backward under a checkpointing policy ('none', 'selective', 'full')."""
    if policy == "full":
        return x.c * x.bs * m.hidden / (x.t if x.sp and x.t > 1 else 1)  # the block's input
    if policy in ("op", "op-fp8"):
        return sum(op_sac_items(m, x, policy == "op-fp8").values())
    items = sparse_block_items(m, x, ep, hf) if sparse else block_items(m, x, hf)
    if policy == "selective":  # the core (attn.core) is recomputed: of it only its inputs and o's input stay
        for inside in ("attention_core", "cp_core"):  # log-sum-exp; the fused blocks' fp32 output (ring, allgather)
            items.pop(inside, None)
        heads, kv_heads = m.heads // x.t, max(1, m.kv_heads // x.t)
        items["qkv"] = x.c * x.bs * m.head_dim * (heads + 2 * kv_heads)  # the local q, k, v (not gathered K, V)
        items["attention_out"] = x.c * x.bs * heads * m.head_dim  # the o projection's input (not SDPA's output)
    return sum(items.values())


def is_checkpointed(layer: int, policy: str, every: int) -> bool:
    """Whether block `layer` (a global index) runs as a checkpointed region."""
    return policy == "full" or (policy == "every-k" and layer % max(1, every) == 0)


def checkpointed_layers(layers: range, policy: str, every: int) -> int:
    """How many of `layers` (global indices) run as checkpointed regions."""
    return sum(1 for i in layers if is_checkpointed(i, policy, every))


@lru_cache(maxsize=65536)
def blocks_bytes(m: ModelConfig, x: Shape, layers: range, policy: str, every: int = 2, hf: bool = False,
                 ep: int = 1) -> float:
    """The saved bytes of a run of blocks under `policy` (none | selective | full | every-k)."""
    k = checkpointed_layers(layers, policy, every) if policy in ("full", "every-k") else 0
    tables = rope_tables(m, x, hf) if len(layers) > k else 0  # one cached pair, if a block outside remat saves it
    if x.cp > 1:  # the core's positions: each block outside remat computes and saves its own pair
        tables *= len(layers) - k
    if policy in ("full", "every-k"):
        kept = [i for i in layers if not is_checkpointed(i, policy, every)]
        sparse = sum(m.is_moe_block(i) for i in kept)
        return (k * block_bytes(m, x, "full", hf) + (len(kept) - sparse) * block_bytes(m, x, "none", hf)
                + sparse * block_bytes(m, x, "none", hf, True, ep) + tables)
    sparse = sum(m.is_moe_block(i) for i in layers)
    return ((len(layers) - sparse) * block_bytes(m, x, policy, hf)
            + (sparse * block_bytes(m, x, policy, hf, True, ep) if sparse else 0.0) + tables)


def rope_tables(m: ModelConfig, x: Shape, hf: bool = False) -> float:
    """The reference decoder's rotary cos/sin tables (fp32, s x d/2 each): cached, so one pair is
    saved per forward whatever the number of blocks (models/decoder.py `rotary_tables`)."""
    return 4 * x.s * m.head_dim if (m.position == "rope" and not hf) else 0


def embedding_bytes(m: ModelConfig, x: Shape, rank_rows: int, hf: bool = False) -> float:
    """Token indices and positions saved by the embedding of one micro-batch."""
    if x.t > 1:
        ids = 9 * x.bs  # masked local ids (int64) and the out-of-slice mask (bool)
    else:  # reference: a view of the rank's rows (under cp the split inputs, a copy)
        ids = 8 * x.bs if hf or x.cp > 1 else 8 * rank_rows * (x.s + 1)
    positions = 8 * x.s if m.position == "learned" else 0
    tables = 2 * x.c * x.s * m.head_dim if (hf and m.position == "rope") else 0
    return ids + positions + tables


def head_bytes(m: ModelConfig, x: Shape, rank_rows: int, with_rows: bool, hf: bool = False) -> float:
    """Final norm, head input, loss of one micro-batch. `with_rows`: the same forward has not already
    saved the rank's rows (a last stage that is not the first, with one-row micro-batches)."""
    norm = norm_items(m, x, hf) + linear_inputs(m, x, 1)
    bs = x.bs
    if hf:
        return norm + 4 * bs * m.vocab + 8 * bs + 4  # whole fp32 logits, shifted labels, the weight scalar
    rows = 8 * rank_rows * (x.s + 1)  # the rank's token rows, when a saved view is the first to reach them
    if x.cp > 1:  # the split targets: a copy of the micro-batch's local part
        rows, with_rows = 8 * bs, True
    if loss_in_pieces(m, x):  # checkpointed pieces (models/loss.py): only their inputs are kept, as views
        head_input = x.c * (x.bs // x.t if x.sp else x.bs) * m.hidden
        return norm_items(m, x, hf) + head_input + (rows if with_rows or x.t > 1 else 0)
    if x.t > 1:
        return norm + x.c * bs * padded(m.padded_vocab, x.t) + 13 * bs  # local logits, log-sum-exp, local ids, mask
    targets = 8 * bs if x.b > 1 or x.cp > 1 else (rows if with_rows else 0)
    return norm + x.c * bs * m.padded_vocab + targets  # softmax - one_hot in the logits' dtype, targets


def loss_in_pieces(m: ModelConfig, x: Shape) -> bool:
    """Whether the reference decoder's head and loss run in checkpointed pieces (`model.loss_chunk`)."""
    return 0 < m.loss_chunk < x.bs


def loss_piece_tokens(m: ModelConfig, x: Shape) -> int:
    """Tokens whose logits exist at once in the loss head: a piece (models/loss.py), or the micro-batch."""
    return piece_tokens(x.b, x.s, m.loss_chunk, x.sp)


def offloaded_block_bytes(m: ModelConfig, x: Shape, layer: int, policy: str, every: int = 2, hf: bool = False,
                          ep: int = 1) -> float:
    """Host bytes one offloaded block (global index `layer`) holds per micro-batch: what it saves under
    `policy`, with the rotary tables it saves itself (each offloaded block copies them)."""
    if is_checkpointed(layer, policy, every):
        return block_bytes(m, x, "full", hf)
    own = "selective" if policy == "selective" else "none"
    return block_bytes(m, x, own, hf, m.is_moe_block(layer), ep) + rope_tables(m, x, hf)


def offload_split(m: ModelConfig, x: Shape, layers: range, policy: str, every: int = 2, hf: bool = False,
                  ep: int = 1, offloaded: tuple[int, ...] = ()) -> tuple[float, float]:
    """(device, host) saved bytes of a run of blocks when the saves of the `offloaded` ones (global
    indices) are held in host memory: the device keeps exactly the other blocks' bytes."""
    moved = [i for i in layers if i in offloaded]
    if not moved:
        return blocks_bytes(m, x, layers, policy, every, hf, ep), 0.0
    kept = tuple(i for i in layers if i not in offloaded)
    device = blocks_bytes(m, x, kept, policy, every, hf, ep) if kept else 0.0
    return device, sum(offloaded_block_bytes(m, x, i, policy, every, hf, ep) for i in moved)
