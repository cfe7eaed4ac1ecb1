"""ZeRO stage 3: parameters sharded over dp, gathered one unit at a time.

Units are the model's natural pieces: each transformer block (`blocks.<i>`, items of a
ModuleList or, in a pipeline stage's module, a ModuleDict), and every other
top-level child with parameters (embed, norm, head); parameters directly on the root form a
root unit. Every parameter is flattened, padded to a multiple of N and cut into N equal
chunks; rank r keeps chunk r as its (1-D) parameter, so `named_parameters()` lists flat shards
under the original names and `Placement.flat_shard` describes each. A unit's chunks sit in one
flat shard buffer. Gathering a unit is one coalesced all-gather over dp
(`Comm.all_gather_many`: one all-gather per parameter, one group call on NCCL) straight into the
storage of each whole parameter - N * chunk elements, of which the parameter is the first numel -
so there is no staging buffer and no copy (with `zero_weight_comm` int8/fp8 the gathered bytes
are dequantized into a staging buffer and copied, as they must be; the weights of tensorwise fp8
matmuls go under `fp8` as the e4m3 bits the matmul uses, scaled by the whole weight's amax, and the
matmul takes them as they came).

    forward   before a unit runs: wait for its all-gather (normally prefetched), put the whole
              parameters in the modules, and start the all-gather of the unit that comes next in
              the forward order (prefetch); after it runs: release it, unless a later unit of
              the same forward needs the same parameters (tied embeddings).
    backward  a hook on the unit's output fires when the gradient reaches it: gather the unit
              again (the forward's autograd graph refers to the same parameter objects, whose
              storage is re-filled) and prefetch the unit before it. When every trainable
              parameter of the unit has accumulated its gradient, the gradients are
              reduce-scattered over dp into the persistent gradient shard and the unit is released
              (a unit with frozen weights - LoRA's base - or nothing to train: when the backward
              reaches the unit before it, since its own backward may still read those weights).

So at most about two units are whole at a time (running and prefetched; a tied unit - the
embedding - stays whole in between, one more): `peak_whole_numel` records it, the tests assert it.

Whole parameters keep their identity between gathers: the storage of each original
`nn.Parameter` is resized to zero when released and re-allocated when gathered (the autograd
graph and the checkpointing recompute see the same objects). The all-gather writes through the
padded tensor over that storage, whose version counter is not the parameter's, so autograd does
not read a re-gather as an in-place modification (the quantized path's copy preserves the
counter explicitly).

Every parameter gather (prefetched or not; quantized too) runs on the `gather` lane of the axis
(`Mesh.add_lane`: a second group over the same dp ranks), the reduce-scatters on the axis's own
group. NCCL runs each communicator's collectives on a CUDA stream of its own in issue order, so
the gather prefetched in the backward no longer waits behind the previous unit's reduce-scatter.
Bytes stay under the axis in the metrics; the records name the lane. hpZ's backward re-gathers
run on `dp_intra`, a group of their own already.

Under pipeline parallelism (`stage_passes=True`, set by `parallelize`) the schedule runs each
(stage, micro-batch) backward - or its input and weight halves - as a pass of its own, with
forwards of other micro-batches in between: every forward gathers and releases its units as
above, and a pass reduce-scatters the units its gradients reached, leaving the others (another
stage's units on this rank, or the weights before a split backward's weight half) for the pass
that reaches them, instead of sending zeros. The weight tied between the first and the last
stage is then already a reduced shard on both ends; both shard it alike (same size, same dp),
so the ends exchange matching shards (`gradient_of`). A split backward's weight half runs no
module hook: the runtime names the weights it is about to use (`gather_for`).

Communication per micro-batch: two all-gathers of the parameters ((N-1)/N W each) and one
reduce-scatter of the gradients ((N-1)/N G): 1.5x plain DP's 2 (N-1)/N G when W = G.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..comm import Comm
from ..comm.quantize import quantized_all_gather, quantized_reduce_scatter
from ..mesh import GATHER
from ..sharding import Placement
from .hpz import NO_HPZ, NoPartition
from .master import Piece
from .materialise import Deferred
from .model import HooklessSync
from .units import tensors, unit_modules
from .zero3_units import (GradHome, Hooked, MatmulCast, ShardedParam, ShardHome, Unit,  # noqa: F401  (re-exported)
                          make_unit, matmul_gather)


class Zero3(HooklessSync):
    """Stage 3 over `axis`: grad-sync interface, parameter gathering, the pieces this rank updates."""

    kind = "ZeRO-3"

    def __init__(self, model: nn.Module, comm: Comm, wire_dtype: torch.dtype | None = None, axis: str = "",
                 prefetch: bool = True, stage_passes: bool = False, weight_comm: str = "none", grad_comm: str = "none",
                 hpz: NoPartition = NO_HPZ, only: set[int] | None = None,
                 units: list[tuple[str, nn.Module]] | None = None, home: ShardHome | None = None,
                 matmul_casts: dict[int, MatmulCast] | None = None, deferred: Deferred | None = None,
                 grad_home: GradHome | None = None):
        axis = axis or comm.mesh.replica_axis  # default: the mesh's replica axes, dp (x cp)
        self.model, self.comm, self.axis, self.hpz = model, comm, axis, hpz  # hpZ: parallel/hpz.py
        self.home = home  # parallel.offload=nvme: the shards in a scratch file between gathers
        self.grad_home = grad_home  # and the reduced gradient shards (not with a pipeline's passes)
        self._fresh: set[int] = set()  # units whose gradient shard is still zero this step (grad_home)
        self.weight_comm, self.grad_comm = weight_comm, grad_comm  # int8 / fp8: comm/quantize.py
        # fp8 gathers: the weights of fp8 matmuls (id -> their kernel) go as the fp8 the matmul uses
        self.matmul_casts = (matmul_casts or {}) if weight_comm == "fp8" else {}
        self.stage_passes = stage_passes  # a pass reduces only the units it reached (pipeline schedules)
        self.wire_dtype = wire_dtype
        self.prefetch = prefetch
        self.deferred = deferred  # parameters still on the meta device: filled here, one unit at a time
        self.initial: dict[str, torch.Tensor] = {}  # their chunks' fp32 values where the model is cast (masters)
        self.n, self.rank = comm.mesh.size(axis), comm.mesh.rank(axis)
        comm.mesh.add_lane(axis, GATHER)  # collective: every rank builds ZeRO-3 at the same point
        self.units: list[Unit] = []
        self.hooked: list[Hooked] = []
        self._build_units(units, only)
        self.root = self.hooked[-1]
        if grad_home is not None:
            self._fresh = {unit.index for unit in self.units}
        self._by_full = {id(sp.full): (unit, sp) for unit in self.units for sp in unit.params}
        for unit in self.units:
            self._use(unit, whole=False)
            for sp in unit.trainable:
                sp.full.register_post_accumulate_grad_hook(self._on_grad)
        for hooked in self.hooked:
            hooked.module.register_forward_pre_hook(functools.partial(self._pre_forward, hooked))
            hooked.module.register_forward_hook(functools.partial(self._post_forward, hooked))
        self._order: list[Hooked] = self.hooked[:-1]  # forward order of units (updated every pass)
        self._order_now: list[Hooked] = []
        self._backward_seen: set[int] = set()
        self._in_backward = False
        self._inflight: list[tuple] = []  # (unit, src, out, handle) reduce-scatters not yet added
        # units with frozen parameters whose backward may still read them: released when the backward
        # reaches an earlier unit's output (by then every node of theirs has run) or at the pass's end
        self._release_later: list[Unit] = []
        self.whole_numel = 0  # elements of units currently gathered (or being gathered)
        self.peak_whole_numel = 0

    # ------------------------------------------------------------ construction

    def _build_units(self, units: list[tuple[str, nn.Module]] | None, only: set[int] | None) -> None:
        """The units, each parameter in the first (in module order) that holds it, the rest in the root's; each
        unit's modules with the units they need (`hooked`). A scratch home takes each unit's values as built."""
        model, home, grad_home = self.model, self.home, self.grad_home
        names = {id(p): name for name, p in model.named_parameters()}
        slots: dict[int, list] = {}
        seen = set()
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and (id(module), attr) not in seen:
                    seen.add((id(module), attr))
                    slots.setdefault(id(p), []).append((module, attr))
        assigned: dict[int, Unit] = {}
        # the units: the model's natural pieces, or those a user's module names (parallel/module.py)
        modules = unit_modules(model) if units is None else list(units)
        if only is not None:  # ids of the parameters to shard (ep: dense over dp, experts over edp, docs/moe.md)
            modules = [(name, m) for name, m in modules if any(id(p) in only for p in m.parameters())]
        for name, module in modules + [("<root>", model)]:
            params = [p for p in module.parameters() if id(p) not in assigned and (only is None or id(p) in only)]
            unit = make_unit(len(self.units), name, [(names[id(p)], p) for p in params], slots, self.n, self.rank,
                             self.comm.mesh.device, self.deferred, self.initial)
            self.units.append(unit)
            if home is not None:  # its values to the file now, its storage released: one unit at a time
                home.add(unit.index, unit.shard_flat, [sp.name for sp in unit.params])
            if grad_home is not None:  # nothing resident, from the build on: gradients go to the file as reduced
                grad_home.add(unit.index, unit.grad_flat, [sp.name for sp in unit.params])
                for sp in unit.trainable:
                    sp.shard.grad = None
            for sp in unit.params:
                assigned[id(sp.full)] = unit
            needs = list(dict.fromkeys(assigned[id(p)] for p in module.parameters() if id(p) in assigned))
            self.hooked.append(Hooked(name, module, needs if module is not model else [unit]))

    def unit_numel(self, unit: Unit) -> int:
        """Elements of a unit when whole, padding included (what a gather materialises)."""
        return self.n * unit.shard_flat.numel()

    # ------------------------------------------------------------ gather and release

    def _use(self, unit: Unit, whole: bool) -> None:
        """Point every module slot at the whole parameters or at the shards."""
        for sp in unit.params:
            target = sp.full if whole else sp.shard
            for module, attr in sp.slots:
                module._parameters[attr] = target

    def _start_gather(self, unit: Unit) -> None:
        if unit.state != "sharded" or not unit.params:
            return
        if self.home is not None:
            self.home.load(unit.index)
        # hpZ's backward: the forward's values from the node-local copy, over dp_intra only
        from_copy = self._in_backward and self.hpz.ready(unit)
        if self.weight_comm != "none" and not from_copy:  # 8 bits on the wire, dequantized into a staging buffer
            buffer = torch.empty(self.unit_numel(unit), dtype=unit.shard_flat.dtype, device=unit.shard_flat.device)
            if any(id(sp.full) in self.matmul_casts for sp in unit.params):
                handle = matmul_gather(self.comm, self.axis, self.n, self.matmul_casts, unit, buffer)
            else:
                handle = quantized_all_gather(self.comm, buffer, unit.shard_flat, self.axis, self.weight_comm, GATHER)
        else:  # every parameter's chunks straight into its whole form's storage (over dp, or hpZ's over dp_intra)
            buffer = None
            for sp in unit.params:
                sp.full.untyped_storage().resize_(sp.padded.numel() * sp.padded.element_size())
            handle = self.hpz.gather(unit) if from_copy else self.comm.all_gather_many(
                [sp.padded for sp in unit.params], [sp.shard.detach() for sp in unit.params], self.axis, GATHER)
        unit.gather, unit.state = (buffer, handle), "gathering"
        self.whole_numel += self.unit_numel(unit)
        self.peak_whole_numel = max(self.peak_whole_numel, self.whole_numel)

    @torch.no_grad()
    def _unshard(self, unit: Unit) -> None:
        if unit.state == "whole" or not unit.params:
            return
        self._start_gather(unit)
        buffer, handle = unit.gather
        handle.wait()
        if self.home is not None:
            self.home.drop(unit.index)
        if buffer is not None:  # the quantized path: dequantized rank-major chunks, copied in place
            rows = buffer.view(self.n, -1)
            for sp in unit.params:
                full = sp.full
                full.untyped_storage().resize_(sp.padded.numel() * sp.padded.element_size())
                values = rows[:, sp.offset: sp.offset + sp.chunk].reshape(-1)[: full.numel()]
                with torch.autograd._unsafe_preserve_version_counter(full):
                    full.view(-1).copy_(values)
        for full, cast, bits, scale in unit.cast:  # the matmuls use the gathered fp8 as it came
            cast.take_weight(full, bits, scale)
        unit.gather, unit.state = None, "whole"
        self._use(unit, whole=True)

    def _reshard(self, unit: Unit) -> None:
        if unit.state == "sharded":
            return
        if unit.state == "gathering":
            unit.gather[1].wait()
            unit.gather = None
            if self.home is not None:
                self.home.drop(unit.index)
        else:
            self._use(unit, whole=False)
        for _, cast, _, _ in unit.cast:
            cast.drop_weight()
        unit.cast = []
        # On CUDA a gather writes this storage on its group's own stream (the gather lane's). Every
        # reader waits for it first (`wait()` makes the current stream wait for the collective), as
        # does a release while gathering, just above; the storage was allocated on the current
        # stream, so the block freed here is reused only by work ordered after the gather: no
        # recordStream needed. The shard the gather reads changes only in the optimizer step, after
        # `_end_pass` waited for every gather.
        for sp in unit.params:
            sp.full.untyped_storage().resize_(0)
        unit.state = "sharded"
        self.whole_numel -= self.unit_numel(unit)

    # ------------------------------------------------------------ forward and backward hooks

    def _pre_forward(self, hooked: Hooked, module, args) -> None:
        for unit in hooked.needs:
            self._unshard(unit)
        if self._in_backward or hooked is self.root:  # recomputation inside backward: already whole
            return
        self.hpz.keep(hooked.needs, torch.is_grad_enabled())  # hpZ: for the backward's gather
        self._order_now.append(hooked)
        if self.prefetch and hooked in self._order:
            position = self._order.index(hooked)
            if position + 1 < len(self._order):
                for unit in self._order[position + 1].needs:
                    self._start_gather(unit)

    def _post_forward(self, hooked: Hooked, module, args, output):
        if self._in_backward:
            return output
        if hooked is not self.root:
            position = self._order.index(hooked) if hooked in self._order else len(self._order)
            later = {id(u) for h in self._order[position + 1:] for u in h.needs}
            for unit in hooked.needs:
                if id(unit) not in later or not torch.is_grad_enabled():
                    self._reshard(unit)
        if torch.is_grad_enabled():
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, hooked))
        elif hooked is self.root:
            self._reshard(self.root.needs[0])
        return output

    def _pre_backward(self, hooked: Hooked, grad) -> None:
        if id(hooked) in self._backward_seen:
            return
        self._backward_seen.add(id(hooked))
        self._in_backward = True
        waiting, self._release_later = self._release_later, []
        for unit in waiting:
            if unit in hooked.needs:
                self._release_later.append(unit)
            else:
                self._reshard(unit)
        for unit in hooked.needs:
            if not unit.reduced:
                self._unshard(unit)
                if not unit.trainable and unit.params:  # nothing to reduce: released by the next unit's backward
                    self._release_later.append(unit)
        if self.prefetch and hooked in self._order_now:
            position = self._order_now.index(hooked)
            if position > 0:
                for unit in self._order_now[position - 1].needs:
                    if not unit.reduced:
                        self._start_gather(unit)

    def _on_grad(self, full: nn.Parameter) -> None:
        unit, _ = self._by_full[id(full)]
        unit.pending -= 1
        if unit.pending == 0:
            self._reduce(unit)
            if unit.frozen:  # the base weights may still be read by this unit's backward (LoRA)
                self._release_later.append(unit)
            else:
                self._reshard(unit)

    # ------------------------------------------------------------ gradient reduction

    @torch.no_grad()
    def _reduce(self, unit: Unit) -> None:
        """Reduce-scatter the unit's whole gradients over dp; this rank keeps the sum of its chunks."""
        unit.reduced = True
        if unit.grad_flat.numel() == 0:
            return
        dtype = self.wire_dtype or unit.grad_flat.dtype
        src = torch.zeros(self.n, unit.grad_flat.numel(), dtype=dtype, device=unit.grad_flat.device)
        for sp in unit.trainable:
            grad = sp.full.grad
            if grad is not None:
                padded = torch.zeros(self.n * sp.chunk, dtype=dtype, device=src.device)
                padded[: sp.numel].copy_(grad.reshape(-1))
                src[:, sp.grad_offset: sp.grad_offset + sp.chunk].copy_(padded.view(self.n, sp.chunk))
                sp.full.grad = None
        out = torch.empty(unit.grad_flat.numel(), dtype=dtype, device=src.device)
        if self.grad_comm != "none":  # all-to-all of 8-bit contributions, summed here in fp32
            handle = quantized_reduce_scatter(self.comm, out, src.view(-1), self.axis, self.grad_comm)
        else:
            handle = self.comm.reduce_scatter(out, src.view(-1), self.axis, async_op=True)
        self._inflight.append((unit, src, out, handle))
        while len(self._inflight) > 2:  # bound the whole gradients alive
            self._complete_one()

    def _complete_one(self) -> None:
        unit, _, out, handle = self._inflight.pop(0)
        handle.wait()
        if self.grad_home is not None:  # zeros + out, as in memory: the same bits
            self.grad_home.accumulate(unit.index, out, unit.index in self._fresh)
            self._fresh.discard(unit.index)
        else:
            unit.grad_flat.add_(out)

    # ------------------------------------------------------------ grad-sync interface

    def _begin_pass(self) -> None:
        if self.home is not None:
            self.home.begin_pass()
        for unit in self.units:
            unit.pending = len(unit.trainable)
            unit.reduced = False
        self._order_now = []
        self._backward_seen = set()
        self._in_backward = False

    def _end_pass(self) -> None:
        """Reduce what backward did not (unused parameters: zeros), in unit order, then release all."""
        for unit in self.units:
            # reached: a gradient arrived (a split backward's weight half assigns `.grad` without hooks)
            reached = any(sp.full.grad is not None for sp in unit.trainable)
            if not unit.reduced and unit.trainable and (reached or not self.stage_passes):
                self._reduce(unit)
        while self._inflight:
            self._complete_one()
        self._release_later = []
        for unit in self.units:
            self._reshard(unit)
        if self._order_now:
            self._order = list(self._order_now)
        self._in_backward = False

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Every micro-batch reduce-scatters its gradients into the shards (never whole across them)."""
        self._begin_pass()
        yield
        self._end_pass()

    @torch.no_grad()
    def gather_for(self, params: list[nn.Parameter]) -> None:
        """Gather the units of `params` (whole forms) for a backward no module hook announces: a split
        backward's weight half re-enters nodes that read the weights (inside a pass; released as usual)."""
        for unit in dict.fromkeys(self._by_full[id(p)][0] for p in params if id(p) in self._by_full):
            if not unit.reduced:
                self._unshard(unit)

    def finish(self) -> None:
        while self._inflight:
            self._complete_one()
        if self.grad_home is not None:  # a unit no gradient reached this step: zeros in the file
            for unit in self.units:
                if unit.index in self._fresh and unit.grad_flat.numel():
                    self.grad_home.accumulate(unit.index, torch.zeros((), dtype=unit.grad_flat.dtype), True)
            self._fresh.clear()

    def zero_grad(self) -> None:
        if self.grad_home is not None:  # the file's gradients count as zeros until this step's arrive
            self._fresh = {unit.index for unit in self.units}
            return
        for unit in self.units:
            unit.grad_flat.zero_()
            for sp in unit.trainable:
                sp.shard.grad = unit.grad_flat[sp.grad_offset: sp.grad_offset + sp.chunk]

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor:
        """Where `param`'s gradient is after the passes: this rank's reduced shard of it (flat, padded)."""
        unit, sp = self._by_full[id(param)]
        return unit.grad_flat[sp.grad_offset: sp.grad_offset + sp.chunk]

    def gradient_tensors(self) -> list[torch.Tensor]:
        return [unit.grad_flat for unit in self.units]

    def weight_tensors(self) -> list[torch.Tensor]:
        """Shards and whole forms: never activations, whatever autograd saves."""
        return [t for unit in self.units for sp in unit.params for t in (sp.shard, sp.full)]

    def reset_peak(self) -> None:
        self.peak_whole_numel = self.whole_numel

    # ------------------------------------------------------------ placements and pieces

    def placements(self, placements: dict[str, Placement]) -> dict[str, Placement]:
        """Each parameter's placement narrowed to this rank's chunk (padding past the end is allowed)."""
        out = dict(placements)
        for unit in self.units:
            for sp in unit.params:
                out[sp.name] = placements[sp.name].flat_shard(self.rank * sp.chunk, (self.rank + 1) * sp.chunk)
        return out

    def pieces(self, placements: dict[str, Placement]) -> list[Piece]:
        out = []
        for unit in self.units:
            for sp in unit.trainable:
                # sliced when asked: with a gradient store the buffer has storage only while its unit is read
                grad = (lambda u=unit, sp=sp: u.grad_flat[sp.grad_offset: sp.grad_offset + sp.chunk])
                out.append(Piece(sp.name, placements[sp.name].flat_shard(self.rank * sp.chunk,
                                                                         (self.rank + 1) * sp.chunk),
                                 sp.shard.detach(), grad, sp.full.dim() >= 2, self.rank * sp.chunk,
                                 self.initial.pop(sp.name, None)))
        return out
