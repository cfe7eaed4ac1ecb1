"""ZeRO over the dp axis (Rajbhandari et al. 2020): shard what data parallelism replicates.

With N data-parallel ranks and P parameters, mixed precision (2-byte params and grads, fp32
masters and Adam moments: 16 bytes per parameter), each rank holds

    stage 0 (plain DP)   2P params + 2P grads + 12P optimizer            = 16P
    stage 1              2P params + 2P grads + 12P/N optimizer          = 4P + 12P/N
    stage 2              2P params + 2P/N grads + 12P/N optimizer        = 2P + 14P/N
    stage 3              2P/N params + 2P/N grads + 12P/N optimizer      = 16P/N

Stages 1 and 2 (this file) keep whole parameters. The trainable parameters are laid out in
the gradient buckets of `buckets.py`, each padded to a multiple of N; rank r owns the r-th
1/N of every bucket. The parameters themselves become views into flat buffers with the same
layout, so after the optimizer updated the owned shards one all-gather per bucket makes every
replica whole again.

    stage 1  gradients accumulate in whole buckets (as plain DP); the last micro-batch's backward
             *reduce-scatters* each bucket as soon as it is full (reduce-scatter over dp), so each
             rank receives the sum of its own shard only.
    stage 2  every micro-batch's backward reduce-scatters each bucket as it fills and adds the
             result into a persistent gradient shard (the step's first reduce-scatter of a bucket
             writes the shard, the later ones add to it). A bucket is whole only from its first
             gradient of a pass until its reduce-scatter is done, in a buffer of a small pool
             (bucket_pool.py, DeepSpeed's "ipg" buffers) that the buckets of a step take in turn:
             each gradient is copied in as autograd produces it (every element written once, so
             nothing is zeroed but the gaps of parameters no gradient reached), and the buffer is
             given back once the reduce-scatter was waited for. The pool's memory is freed at the
             end of the step: between steps a rank holds only its gradient shards.

Communication per step, per rank (ring volumes, counted by `comm/`): reduce-scatter of the
gradients (N-1)/N G plus all-gather of the parameters (N-1)/N W - the 2 (N-1)/N G of plain
DP's all-reduce when parameters and reduced gradients have the same dtype, because an
all-reduce *is* a reduce-scatter followed by an all-gather: ZeRO 1/2 only moves the update
between the two halves. (The paper counts it this way; an implementation that all-reduced the
gradients and then all-gathered the parameters would send 1.5x plain DP.) Stage 2 with M
micro-batches reduce-scatters M times per step: that is the price of never holding whole
gradients across micro-batches.

Under pipeline parallelism (`defer=True`, set by `parallelize`) stage 2 keeps whole gradient
buckets across the schedule's micro-batches and reduce-scatters once, in `finish()`: the
schedule interleaves the micro-batches' backward passes of several stages, and the weights tied
between the first and last stage must exchange whole gradients before any reduce-scatter (the
two ends lay out their buckets differently, so their shards would not match). Whole buckets
then live during the step only; between steps a rank holds its gradient shards, as without
pipelining.

Segments. Each bucket is cut into up to `GATHER_SEGMENTS` contiguous segments (each a multiple
of N long); rank r owns the r-th 1/N of every segment, and each segment is reduce-scattered and
all-gathered on its own (the same bytes as one collective per bucket). The all-gather after the
optimizer step is thereby split in pieces the next forward can wait for one by one (Megatron's
overlap_param_gather): `launch_param_gather()` starts every segment's all-gather - the segments
the forward needs first (the first layers sit at the end of the last bucket) first - and a forward
pre-hook on each module with parameters waits only for the segments holding that module's
parameters, so the gathers of later layers overlap the forward of earlier ones. Every other
reader of the parameters (checkpoints, replica checks, the end of a run) calls `settle()` first
(`ParallelModel.settle`); `finish()` settles too. Segment boundaries do not depend on the rank,
so every rank issues the same collectives in the same order.

Stage 3 (zero3.py) shards the parameters too.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from ..comm import AllOf, Comm
from ..sharding import Placement
from .bucket_pool import BufferPool
from .bucket_pool import view as pool_view
from .buckets import Bucket, GradientBuckets
from .master import Piece
from .model import HooklessSync

GATHER_SEGMENTS = 4  # per bucket: the forward waits for the segment a module needs, not the whole bucket
SEGMENT_MIN_BYTES = 2**20  # smaller buckets stay one segment (a collective's fixed cost would dominate)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _constant(t: torch.Tensor):
    return lambda: t


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def segments(numel: int, n: int, element_size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges cutting a bucket of `numel` elements (a multiple of n) into at most
    `GATHER_SEGMENTS` contiguous pieces of at least `SEGMENT_MIN_BYTES`, each a multiple of n long."""
    count = max(1, min(GATHER_SEGMENTS, numel * element_size // max(1, SEGMENT_MIN_BYTES)))
    size = -(-numel // (count * n)) * n or n
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)] or [(0, 0)]


class ZeroReducer(HooklessSync):
    """ZeRO stage 1 or 2 over `axis`: the grad-sync interface plus the pieces this rank updates."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm, stage: int,
                 bucket_mb: float = 25.0, wire_dtype: torch.dtype | None = None, axis: str = "",
                 defer: bool = False):
        assert stage in (1, 2)
        axis = axis or comm.mesh.replica_axis  # default: the mesh's replica axes, dp (x cp)
        self.comm, self.stage, self.axis = comm, stage, axis
        self.kind = f"ZeRO-{stage}"
        self.defer = defer  # stage 2: accumulate whole buckets, reduce-scatter in finish() only (pipeline)
        self.wire_dtype = wire_dtype
        self.n, self.rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        trainable = [(name, p) for name, p in named_params if p.requires_grad]
        self.names = {id(p): name for name, p in trainable}
        pooled = stage == 2 and not defer  # stage 2 fills pooled buffers by copy (see the module's docstring)
        self.buckets = GradientBuckets([p for _, p in trainable], int(bucket_mb * 2**20), launch=self._launch,
                                       complete=self._complete, pad_to=self.n,
                                       arrive=self._arrive if pooled else None)
        whole = [b.numel() * b.buffer.element_size() for b in self.buckets.buckets]
        self.pool = BufferPool(max(whole), self.buckets.buckets[0].buffer.device) if pooled and whole else None
        self._offset = {id(p): off for b in self.buckets.buckets for p, off in zip(b.params, b.offsets)}
        self._fresh = set(range(len(whole)))  # stage 2: buckets whose next reduce-scatter writes the shard
        self.param_flats: list[torch.Tensor] = []  # the parameters, bucket layout; params are views
        self.grad_shards: list[torch.Tensor] = []  # stage 2: this rank's summed gradient shard per bucket
        self.segments = [segments(b.numel(), self.n, b.buffer.element_size()) for b in self.buckets.buckets]
        self._gathers: dict[tuple[int, int], object] = {}  # (bucket, segment) -> all-gather in flight
        self._gather_due = False  # the optimizer stepped; the all-gathers start with the next forward
        self._update_pre_hooks: list[Callable[[], None]] = []  # before the all-gathers write the parameters
        for b in self.buckets.buckets:
            flat = torch.zeros(b.numel(), dtype=b.buffer.dtype, device=b.buffer.device)
            for p, off in zip(b.params, b.offsets):
                flat[off: off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off: off + p.numel()].view_as(p)
            self.param_flats.append(flat)
            if stage == 2:
                self.grad_shards.append(torch.zeros(self.shard_len(b), dtype=b.buffer.dtype, device=flat.device))
                if defer:  # whole buckets accumulate over the schedule's micro-batches
                    for p in b.params:  # runs before autograd accumulates into p.grad (a view of the bucket)
                        p.register_hook(functools.partial(self._materialize, b))
                self._release(b)

    def shard_len(self, bucket: Bucket) -> int:
        return bucket.numel() // self.n

    def owned(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """(lo, hi, offset in the shard) of this rank's range of every segment of `bucket`."""
        out, offset = [], 0
        for lo, hi in self.segments[bucket.index]:
            length = (hi - lo) // self.n
            out.append((lo + self.rank * length, lo + (self.rank + 1) * length, offset))
            offset += length
        return out

    # ------------------------------------------------------------ during backward

    def _arrive(self, bucket: Bucket, param: nn.Parameter) -> None:
        """Stage 2 (pooled): copy `param`'s gradient of this pass into its bucket's pooled buffer."""
        grad, param.grad = param.grad, None
        if grad is None:
            return
        if bucket.launched:
            raise RuntimeError(f"the gradient of {self.names[id(param)]} arrived after its bucket was reduced")
        whole = self._pooled(bucket)
        off = self._offset[id(param)]
        dst = whole[off: off + param.numel()].view_as(param)
        if id(param) in bucket.state["seen"]:  # a second accumulation in one pass
            dst.add_(grad)
        else:
            dst.copy_(grad)
            bucket.state["seen"].add(id(param))

    def _pooled(self, bucket: Bucket) -> torch.Tensor:
        """Stage 2 (pooled): the bucket's whole buffer this pass, taken from the pool at its first use.

        With every buffer out, the oldest bucket in flight is waited for and completed (which gives
        its buffer back); a buffer is never taken while its reduce-scatter may still read it."""
        whole = bucket.state.get("whole")
        if whole is not None:
            return whole
        raw = self.pool.take()
        while raw is None:
            older = next((b for b in self.buckets.buckets if "raw" in b.state and b.handle is not None), None)
            if older is None:  # every buffer out belongs to a bucket still filling
                raw = self.pool.grow()
                break
            older.handle.wait()
            self._complete(older)
            raw = self.pool.take()
        whole = pool_view(raw, bucket.numel(), bucket.buffer.dtype)
        bucket.state.update(raw=raw, whole=whole, seen=set())
        return whole

    @staticmethod
    def _fill_gaps(bucket: Bucket, whole: torch.Tensor) -> None:
        """Zero what no gradient was copied into this pass: unused parameters and the padding."""
        seen = bucket.state["seen"]
        for p, off in zip(bucket.params, bucket.offsets):
            if id(p) not in seen:
                whole[off: off + p.numel()].zero_()
        whole[bucket.offsets[-1] + bucket.params[-1].numel():].zero_()

    def _materialize(self, bucket: Bucket, grad: torch.Tensor | None) -> None:
        """Stage 2 under a pipeline: re-allocate a released bucket (zeroed) when its first gradient arrives.

        Runs as a tensor hook, before autograd accumulates into `p.grad`, so the gradients
        accumulate into the bucket as in plain DP.
        """
        if not _allocated(bucket.buffer):
            bucket.buffer.untyped_storage().resize_(bucket.numel() * bucket.buffer.element_size())
            bucket.buffer.zero_()
            for p, off in zip(bucket.params, bucket.offsets):
                p.grad = bucket.buffer[off: off + p.numel()].view_as(p)

    @staticmethod
    def _release(bucket: Bucket) -> None:
        """Stage 2: give a reduced bucket's memory back; its parameters have no `.grad` until the next pass."""
        for p in bucket.params:
            p.grad = None
        _free(bucket.buffer)

    def _launch(self, bucket: Bucket):
        if self.pool is not None:
            src = self._pooled(bucket)
            self._fill_gaps(bucket, src)
        else:
            if self.stage == 2:  # bound the whole buckets alive: finish all but the previous one
                for older in self.buckets.buckets[: max(0, bucket.index - 1)]:
                    if older.handle is not None:
                        older.handle.wait()
                        self._complete(older)
            self._materialize(bucket, None)  # a bucket no gradient reached this pass is all zeros
            src = bucket.buffer
        if self.wire_dtype is not None and self.wire_dtype != src.dtype:
            src = src.to(self.wire_dtype)
        shard = self.grad_shards[bucket.index] if self.stage == 2 else None
        write = shard is not None and bucket.index in self._fresh and src.dtype == shard.dtype
        self._fresh.discard(bucket.index)  # the step's first reduce-scatter writes the shard, later ones add
        out = shard if write else torch.empty(self.shard_len(bucket), dtype=src.dtype, device=src.device)
        bucket.state.update(src=src, out=out, add=shard is not None and not write)
        # reduce-scatter over dp, per segment: this rank receives the sum over ranks of its shard
        return AllOf([self.comm.reduce_scatter(out[off: off + (hi - lo) // self.n], src[lo:hi], self.axis,
                                               async_op=True)
                      for (lo, hi), (_, _, off) in zip(self.segments[bucket.index], self.owned(bucket))])

    def _complete(self, bucket: Bucket) -> None:
        out = bucket.state.pop("out", None)
        if out is None:  # already completed early
            return
        bucket.state.pop("src", None)
        add = bucket.state.pop("add")
        if self.stage == 1:
            for lo, hi, off in self.owned(bucket):
                bucket.buffer[lo:hi].copy_(out[off: off + hi - lo])
            return
        if add:
            self.grad_shards[bucket.index].add_(out)
        if self.pool is None:
            self._release(bucket)
            return
        self.pool.give_back(bucket.state.pop("raw"))
        del bucket.state["whole"], bucket.state["seen"]

    # ------------------------------------------------------------ grad-sync interface

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Stage 1 communicates in the last micro-batch only; stage 2 in every one (deferred: in finish())."""
        if self.stage == 1 or self.defer:
            with self.buckets.accumulating(last):
                yield
            return
        self.buckets.sync = True
        yield
        if not last:
            self.buckets.flush()

    def finish(self) -> None:
        self.settle()
        self.buckets.flush()
        if self.pool is not None:
            self.pool.release()  # between steps: the gradient shards only

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.buckets.zero_grad()
            return
        self._fresh = set(range(len(self.buckets.buckets)))
        for shard in self.grad_shards:
            if (self.wire_dtype or shard.dtype) != shard.dtype:  # reduced in another dtype: added, not written
                shard.zero_()
        for b in self.buckets.buckets:
            if _allocated(b.buffer):
                b.buffer.zero_()

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor:
        """Where `param`'s gradient accumulates before `finish()`: its (whole) view of the bucket."""
        if self.pool is not None:
            raise RuntimeError("ZeRO-2 outside a pipeline holds no whole gradient outside backward")
        if self.stage == 2:
            self._materialize(self.buckets.bucket_of(param), None)
        return param.grad

    def gradient_tensors(self) -> list[torch.Tensor]:
        """Gradient storage of this rank (released stage-2 buckets and pool buffers count zero bytes)."""
        return [b.buffer for b in self.buckets.buckets] + self.grad_shards + (self.pool.buffers if self.pool else [])

    def weight_tensors(self) -> list[torch.Tensor]:
        return []  # the parameters are views of `param_flats`, already the module's parameters

    def gather_for(self, params: list[nn.Parameter]) -> None:
        """Nothing to gather: every rank holds its parameters whole."""

    # ------------------------------------------------------------ the optimizer's view

    def pieces(self, placements: dict[str, Placement]) -> list[Piece]:
        """For every bucket, the parts of its parameters inside this rank's shard."""
        out = []
        for b, flat in zip(self.buckets.buckets, self.param_flats):
            for lo, hi, shard_off in self.owned(b):
                for p, off in zip(b.params, b.offsets):
                    start, end = max(off, lo), min(off + p.numel(), hi)
                    if start >= end:
                        continue
                    name = self.names[id(p)]
                    if self.stage == 1:
                        grad = b.buffer[start:end]
                    else:
                        grad = self.grad_shards[b.index][shard_off + start - lo: shard_off + end - lo]
                    out.append(Piece(name, placements[name].flat_shard(start - off, end - off), flat[start:end],
                                     _constant(grad), p.dim() >= 2, start - off))
        return out

    # ------------------------------------------------------------ the parameters after the step

    def defer_param_gather(self) -> None:
        """After the optimizer step: the all-gathers start when the next forward does (or `settle()`).

        Not at once: the step's own small collectives that follow (the logged loss) would queue
        behind them on the same communicator and wait for the whole gather."""
        self._gather_due = True

    @torch.no_grad()
    def launch_param_gather(self) -> None:
        """Start every segment's all-gather over dp (this rank's updated range to every replica),
        in the order the forward needs them; nothing waits here."""
        self._gather_due = False
        for hook in self._update_pre_hooks:  # e.g. an async checkpoint still copying the parameters
            hook()
        for b in reversed(self.buckets.buckets):  # the first layers are in the last bucket, at its end
            flat, owned = self.param_flats[b.index], self.owned(b)
            for i in reversed(range(len(owned))):
                (lo, hi), (own_lo, own_hi, _) = self.segments[b.index][i], owned[i]
                self._gathers[(b.index, i)] = self.comm.all_gather(flat[lo:hi], flat[own_lo:own_hi].clone(),
                                                                   self.axis, async_op=True)

    def register_update_pre_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs before the all-gathers write the updated shards into the parameters."""
        self._update_pre_hooks.append(hook)

    def settle(self) -> None:
        """Wait for every parameter all-gather still due or in flight: the parameters are whole after it."""
        if self._gather_due:
            self.launch_param_gather()
        for key in list(self._gathers):
            self._gathers.pop(key).wait()

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer step: every rank's updated shard to every replica, waited for at once."""
        self.launch_param_gather()
        self.settle()

    def overlap_gather(self, module: nn.Module, units: list[nn.Module] | None = None) -> None:
        """Let `module`'s forward wait for each parameter's segments just before the first module
        holding it runs (instead of `gather_params` waiting for all after the step); the root's
        forward ends by settling the rest (a parameter read without being registered anywhere).

        `units` (a user's module, parallel/module.py): wait per unit for every parameter inside it, and
        in the root's forward for the rest, since such a forward may read a child's parameters without
        calling the child (nn.MultiheadAttention reads out_proj.weight)."""
        where = {id(p): (b.index, off, off + p.numel()) for b in self.buckets.buckets
                 for p, off in zip(b.params, b.offsets)}
        if units is not None:
            inside = {id(p) for unit in units for p in unit.parameters()}
            rest = [p for p in module.parameters() if id(p) not in inside]
        for sub in (module.modules() if units is None else [*units, module]):
            keys = []
            params = (sub.parameters(recurse=False) if units is None
                      else rest if sub is module else sub.parameters())
            for p in params:
                if id(p) not in where:
                    continue
                index, start, end = where[id(p)]
                keys += [(index, i) for i, (lo, hi) in enumerate(self.segments[index]) if lo < end and start < hi]
            if keys:
                sub.register_forward_pre_hook(functools.partial(self._wait_for, list(dict.fromkeys(keys))))
        module.register_forward_pre_hook(self._start_due, prepend=True)
        module.register_forward_hook(lambda *_: self.settle())

    def _start_due(self, module, args) -> None:
        if self._gather_due:
            self.launch_param_gather()

    def _wait_for(self, keys: list[tuple[int, int]], module, args) -> None:
        for key in keys:
            handle = self._gathers.pop(key, None)
            if handle is not None:
                handle.wait()
