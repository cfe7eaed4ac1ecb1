"""Context parallelism (cp) in the plan: the bytes of one attention call per method, and their time.

`theoretical_bytes` is the one formula of docs/context.md "Bytes per attention call" (pure
arithmetic, no torch): the planner charges it, and parallel/context.py re-exports it for the
runtime's tests, which check Comm's counts against it on every rank. Bytes one rank sends, in Comm's convention, for b sequences of s = S/cp local
tokens, head size d, e bytes per element, h and h_kv heads (per tp rank: tp splits the heads first),
KV = 2 b h_kv s d and the mask gather M = (cp-1) b s 8 (x2 packed):

    ring       forward M + send (cp-1) KV e          backward send (cp-1) KV (e + 4)
    allgather  forward M + all_gather (cp-1) KV e    backward reduce_scatter (cp-1) KV e
    ulysses    forward M + all_to_all (cp-1)/cp b s d (2h + 2h_kv) e, backward the same all_to_all

Time (`attention_seconds`) on the cp group's link (planner/comm.py: the group is `cp` ranks of stride
tp, inside a node when tp x cp <= GPUs per node): every collective alpha per step + bytes sent / beta.
allgather and ulysses are exposed collectives (the attention needs their result). The ring's cp-1
hops each overlap the attention of the block already held (the next block is posted before the
current one is computed), so a hop costs max(compute, transfer): what is charged as communication
is the exposed part, (cp-1) max(0, hop - attention / cp), forward and backward (whose hop carries
K,V again and the fp32 dK,dV accumulator). The mask gather is one small exposed all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import comm
from .hardware import Gpu

METHODS = ("ring", "allgather", "ulysses")
ACC_BYTES = 4  # the ring's dK / dV accumulators travel in fp32


def theoretical_bytes(method: str, cp: int, batch: int, heads: int, kv_heads: int, local_seq: int, head_dim: int,
                      element: int, packed: bool) -> dict[str, dict[str, int]]:
    """Bytes one rank sends for one attention call, {"forward": {op: bytes}, "backward": {op: bytes}},
    in Comm's convention (docs/context.md). `element`: bytes per element of q, k, v."""
    if cp == 1:
        return {"forward": {}, "backward": {}}
    mask = (cp - 1) * batch * local_seq * 8 * (2 if packed else 1)
    kv = 2 * batch * kv_heads * local_seq * head_dim  # elements of one rank's K and V
    if method == "ring":
        return {"forward": {"all_gather.mask": mask, "send": (cp - 1) * kv * element, "recv": 0},
                "backward": {"send": (cp - 1) * kv * (element + ACC_BYTES), "recv": 0}}
    if method == "allgather":
        return {"forward": {"all_gather.mask": mask, "all_gather": (cp - 1) * kv * element},
                "backward": {"reduce_scatter": (cp - 1) * kv * element}}
    if method == "ulysses":
        moved = (cp - 1) * batch * local_seq * head_dim * (2 * heads + 2 * kv_heads) * element // cp
        return {"forward": {"all_gather.mask": mask, "all_to_all": moved}, "backward": {"all_to_all": moved}}
    raise ValueError(method)


def ulysses_splits(heads: int, kv_heads: int, cp: int, tp: int) -> bool:
    """Whether ulysses can split the heads over cp after tp split them (config/checks.py's rule)."""
    return heads % (cp * tp) == 0 and kv_heads % (cp * tp) == 0


@dataclass(frozen=True)
class CallSeconds:
    """One attention call of one micro-batch on one rank: seconds on the critical path (exposed) and
    the ring's transfer time hidden behind its block attention, forward and backward."""

    forward: float
    backward: float
    forward_hidden: float = 0.0
    backward_hidden: float = 0.0


def _collective(nbytes: float, cp: int, link: comm.Link) -> float:
    """A collective over cp ranks in which one rank sends `nbytes`: cp-1 steps, its bytes over the link."""
    return (cp - 1) * link.latency_s + nbytes / link.bytes_per_s if nbytes else 0.0


def attention_seconds(method: str, cp: int, batch: int, heads: int, kv_heads: int, local_seq: int, head_dim: int,
                      element: int, link: comm.Link, attention_forward_s: float) -> CallSeconds:
    """Communication seconds of one attention call (the figures of `theoretical_bytes`, per tp rank's
    heads) on `link`; `attention_forward_s`: the call's attention compute in forward (its backward is
    twice that), which hides the ring's hops."""
    if cp == 1:
        return CallSeconds(0.0, 0.0)
    figures = theoretical_bytes(method, cp, batch, heads, kv_heads, local_seq, head_dim, element, False)
    fwd, bwd = figures["forward"], figures["backward"]
    mask = _collective(fwd["all_gather.mask"], cp, link)
    if method == "ring":
        hops = cp - 1
        out = []
        for sent, compute in ((fwd["send"], attention_forward_s), (bwd["send"], 2 * attention_forward_s)):
            hop = link.latency_s + sent / hops / link.bytes_per_s
            exposed = hops * max(0.0, hop - compute / cp)
            out.append((exposed, hops * hop - exposed))
        (f, fh), (b, bh) = out
        return CallSeconds(mask + f, b, fh, bh)
    op_f, op_b = ("all_gather", "reduce_scatter") if method == "allgather" else ("all_to_all", "all_to_all")
    return CallSeconds(mask + _collective(fwd[op_f], cp, link), _collective(bwd[op_b], cp, link))


def cp_link(gpu: Gpu, tp: int, cp: int) -> comm.Link:
    """The link of a cp group: cp ranks of stride tp (mesh order pp, dp, cp, tp)."""
    return comm.axis_link(gpu, "cp", tp, 1, cp)
