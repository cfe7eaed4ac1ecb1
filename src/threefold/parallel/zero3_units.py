"""ZeRO-3's records and its two free-standing pieces of work (parallel/zero3.py drives them): a unit's build
(`make_unit`: this rank's chunks in one flat shard, each whole form on storage of its own) and the fp8
gather of a unit holding the weights of fp8 matmuls (`matmul_gather`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from ..comm import Comm
from ..comm.quantize import Pending, quantized_all_gather
from ..mesh import GATHER
from .materialise import Deferred


@dataclass(eq=False)
class ShardedParam:
    name: str  # local parameter name
    full: nn.Parameter  # the original object: whole while its unit is gathered, empty storage otherwise
    shard: nn.Parameter  # this rank's chunk, a view into the unit's shard buffer
    chunk: int  # elements per rank (numel padded to a multiple of N, divided by N)
    offset: int  # in the unit's shard buffer
    grad_offset: int | None  # in the unit's gradient shard buffer; None when frozen
    slots: list[tuple[nn.Module, str]]  # every (module, attribute) holding this parameter
    padded: torch.Tensor  # (N * chunk,) over the whole form's storage: the all-gather's output

    @property
    def numel(self) -> int:
        return self.full.numel()


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    params: list[ShardedParam]
    shard_flat: torch.Tensor  # (C,) this rank's chunks of every parameter
    grad_flat: torch.Tensor  # (Cg,) this rank's summed gradient chunks of the trainable ones
    state: str = "sharded"  # sharded | gathering | whole
    gather: tuple | None = None  # (buffer, handle) while gathering
    cast: list = field(default_factory=list)  # (param, its MatmulCast, bits, scale) from an fp8 matmul gather
    pending: int = 0  # trainable gradients still to arrive in this backward pass
    reduced: bool = False  # gradients reduce-scattered in this pass

    @property
    def trainable(self) -> list[ShardedParam]:
        return [sp for sp in self.params if sp.grad_offset is not None]

    @property
    def frozen(self) -> bool:
        """Whether some parameter without a gradient is one a backward reads (LoRA's base weights and
        norms, not a frozen bias): the unit's backward may still read it after the last trainable
        gradient arrived."""
        return any(sp.grad_offset is None and not sp.name.endswith("bias") for sp in self.params)


@dataclass(eq=False)
class Hooked:
    """A module with gather/release hooks and the units whose parameters it uses."""

    name: str
    module: nn.Module
    needs: list[Unit] = field(default_factory=list)


class MatmulCast(Protocol):
    """A linear's fp8 matmul that takes its weight already cast (parallel/fp8.py `Fp8Kernel`, tensorwise): with
    `parallel.zero_weight_comm=fp8` the gather sends that weight as the fp8 the matmul uses, once."""

    def weight_scale(self, amax: torch.Tensor) -> torch.Tensor: ...
    def weight_bits(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...
    def take_weight(self, weight: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor) -> None: ...
    def drop_weight(self) -> None: ...


class ShardHome(Protocol):
    """Where the units' flat shards live between gathers when not in memory (parallel/shard_store.py ShardStore):
    `load` before a gather reads a shard, `drop` once the gather has completed, `begin_pass` at each pass."""

    def add(self, index: int, shard: torch.Tensor, names: list[str]) -> None: ...
    def load(self, index: int) -> None: ...
    def drop(self, index: int) -> None: ...
    def begin_pass(self) -> None: ...


class GradHome(Protocol):
    """Where the units' reduced gradient shards live between micro-batches and until the step reads them
    (parallel/shard_store.py ShardStore, a file of its own): each reduce-scatter's result is added in place."""

    def add(self, index: int, shard: torch.Tensor, names: list[str]) -> None: ...
    def accumulate(self, index: int, values: torch.Tensor, fresh: bool) -> None: ...


def make_unit(index: int, name: str, named: list[tuple[str, nn.Parameter]], slots: dict, n: int, r: int,
              device: torch.device, deferred: Deferred | None, initial: dict[str, torch.Tensor]) -> Unit:
    """Unit `index` of `named`: this rank (`r` of `n`) keeps its chunk of each parameter in one flat shard;
    the whole forms get storage of their own, empty until gathered. `initial` gets the fp32 chunks of a cast."""
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise ValueError(f"ZeRO-3 unit {name} mixes parameter dtypes {dtypes}; cast the model to one dtype")
    dtype = dtypes.pop() if dtypes else torch.float32
    device = named[0][1].device if named and named[0][1].device.type != "meta" else device
    chunks = [-(-p.numel() // n) for _, p in named]
    # a deferred build (materialise.Deferred): this unit's whole values now, each dropped once its chunk is kept
    meta = [p for _, p in named if deferred is not None and deferred.holds(p)]
    values = dict(zip(map(id, meta), deferred.values(meta))) if meta else {}
    shard_flat = torch.zeros(sum(chunks), dtype=dtype, device=device)
    grad_flat = torch.zeros(sum(c for c, (_, p) in zip(chunks, named) if p.requires_grad), dtype=dtype,
                            device=device)
    params, offset, grad_offset = [], 0, 0
    with torch.no_grad():
        for (name_p, p), c in zip(named, chunks):
            whole = values.pop(id(p), p).reshape(-1)  # this rank's chunk; the padding past numel stays zero
            lo, hi = min(r * c, whole.numel()), min((r + 1) * c, whole.numel())
            shard_flat[offset: offset + hi - lo].copy_(whole[lo: hi])
            if whole.dtype != dtype and p.requires_grad:  # the chunk's values before the cast, for its master
                initial[name_p] = torch.zeros(c, dtype=torch.float32, device=device)
                initial[name_p][: hi - lo].copy_(whole[lo: hi])
            del whole
            shard = nn.Parameter(shard_flat[offset: offset + c], requires_grad=p.requires_grad)
            goff = None
            if p.requires_grad:
                goff = grad_offset
                shard.grad = grad_flat[goff: goff + c]
                grad_offset += c
            # the whole form is the first numel elements of an N * chunk storage of its own, which
            # the all-gather fills directly (no staging buffer, no copy)
            padded = torch.empty(n * c, dtype=dtype, device=device)
            numel, shape = p.numel(), p.shape
            if p.device.type == "meta":  # a meta tensor's data cannot be replaced: give the object storage first
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                         p.requires_grad))
            p.data = padded[: numel].view(shape)
            p.grad = None
            p.untyped_storage().resize_(0)
            params.append(ShardedParam(name_p, p, shard, c, offset, goff, slots[id(p)], padded))
            offset += c
    return Unit(index, name, params, shard_flat, grad_flat)


def matmul_gather(comm: Comm, axis: str, n: int, casts: dict[int, MatmulCast], unit: Unit,
                  buffer: torch.Tensor) -> Pending:
    """An fp8 gather of a unit holding weights of fp8 matmuls: each such weight is sent once, as the
    e4m3 bits of its tensorwise cast (the whole weight's amax: this rank's chunk's, all-gathered
    on the gather lane and maxed, then the kernel's own rule over tp), so every rank receives exactly
    the operand the matmul would cast from the whole weight; the unit's other parameters (norms,
    biases) go block-wise as in `quantized_all_gather`. `buffer` gets every value dequantized, as there."""
    dev = unit.shard_flat.device
    mm = [sp for sp in unit.params if id(sp.full) in casts]
    rest = [sp for sp in unit.params if id(sp.full) not in casts]
    chunks = [unit.shard_flat[sp.offset: sp.offset + sp.chunk] for sp in mm]
    amax = torch.stack([c.abs().amax().float() for c in chunks])
    amaxes = torch.empty(n * len(mm), dtype=torch.float32, device=dev)
    comm.all_gather(amaxes, amax, axis, tag="fp8_amax", lane=GATHER)
    top = amaxes.view(n, len(mm)).amax(dim=0)
    scales = [casts[id(sp.full)].weight_scale(top[i]) for i, sp in enumerate(mm)]
    payload = torch.cat([casts[id(sp.full)].weight_bits(c, s).view(torch.uint8)
                         for sp, c, s in zip(mm, chunks, scales)])
    received = torch.empty(n * payload.numel(), dtype=torch.uint8, device=dev)
    handles = [comm.all_gather(received, payload, axis, async_op=True, lane=GATHER)]
    if rest:
        flat = torch.cat([unit.shard_flat[sp.offset: sp.offset + sp.chunk] for sp in rest])
        rest_out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=dev)
        handles.append(quantized_all_gather(comm, rest_out, flat, axis, "fp8", GATHER))

    def finish():
        for handle in handles[1:]:
            handle.wait()
        rows, got = buffer.view(n, -1), received.view(n, -1)
        unit.cast = []
        start = 0
        for sp, s in zip(mm, scales):
            bits = got[:, start: start + sp.chunk]
            start += sp.chunk
            rows[:, sp.offset: sp.offset + sp.chunk] = (bits.view(torch.float8_e4m3fn).float() / s).to(rows.dtype)
            whole = bits.reshape(-1)[: sp.numel].view(torch.float8_e4m3fn).view(sp.full.shape)
            unit.cast.append((sp.full, casts[id(sp.full)], whole, s))
        if rest:
            values, start = rest_out.view(n, -1), 0
            for sp in rest:
                rows[:, sp.offset: sp.offset + sp.chunk] = values[:, start: start + sp.chunk]
                start += sp.chunk

    return Pending(handles[:1], finish)
