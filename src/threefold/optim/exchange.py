"""Whole matrices from pieces: each matrix assembled on one owner rank, `fn` applied there once,
the result scattered back to every piece (Muon's Newton-Schulz; any whole-matrix optimizer).

A rank's piece of a matrix is a tp box of it (Placement offsets/shape, fused blocks included)
and, under ZeRO, a flat range of that box; plain data parallelism holds the box whole on every
dp rank. The matrices of a pipeline stage are spread over the stage's dp x tp ranks: sorted by
size (largest first, then name), the k-th is owned by grid position k mod (dp tp), i.e. dp
coordinate (k mod dp tp) // tp and tp coordinate k mod tp. Two hops each way, each one
`Comm.all_to_all_v` (the stage's matrices together):

    gather  A over dp   the ranks of the owner's dp coordinate receive the rest of their box
                        (ZeRO's ranges; nothing under plain dp: the box is whole there)
            B over tp   the owner receives the other tp boxes (nothing if its box is the whole matrix)
    fn on the owner
    scatter B over tp   each tp box of the result back to the owner's dp coordinate
            A over dp   each dp rank's range (its whole box under plain dp) back to it

Bytes (fp32, what `Comm` counts, docs/zero.md "Muon"): per matrix of N elements, with h the
elements of its tp box the owner's dp coordinate holds and L the box size,

    B: 2 (N - N_owner_box)                        (ZeRO and plain alike; 2 N (tp-1)/tp for even boxes)
    A: 2 (L_sum - h_sum)   under ZeRO             (2 N (dp-1)/dp for even ranges)
       (dp - 1) N          under plain dp         (the whole box to every other replica, scatter only)

with the sums over the tp coordinates. The plan is made once from every rank's placements
(exchanged with all_gather_object at construction: bookkeeping of the layout, not model
traffic, as Mesh._connect's probe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from ..sharding import Placement


@dataclass
class _Matrix:
    name: str
    shape: tuple[int, ...]
    owner: tuple[int, int]  # (dp, tp) coordinates
    boxes: dict[int, Placement] = field(default_factory=dict)  # tp coordinate -> its box (no flat range)
    ranges: dict[tuple[int, int], tuple[int, int] | None] = field(default_factory=dict)  # (dp, tp) -> range

    def box_numel(self, t: int) -> int:
        return math.prod(self.boxes[t].local_shape())

    def real(self, d: int, t: int) -> tuple[int, int]:
        """The range (dp, tp) holds of its box, clipped to the box (ZeRO-3 pads the last range);
        (0, 0) where it holds none (ZeRO-1/2: a bucket's ranges need not touch every parameter)."""
        if (d, t) not in self.ranges:
            return 0, 0
        r = self.ranges[(d, t)]
        n = self.box_numel(t)
        return (0, n) if r is None else (min(r[0], n), min(r[1], n))

    def sharded(self, t: int) -> bool:
        """The box at tp coordinate t is split over dp (ZeRO) rather than whole on every dp rank."""
        return any(r is not None for (d, tt), r in self.ranges.items() if tt == t)

    def whole_box_at_owner(self) -> bool:
        return self.box_numel(self.owner[1]) == math.prod(self.shape)


class MatrixExchange:
    """`orthogonalise(updates, fn)` over this rank's pieces (module text). `comm` None: one process."""

    def __init__(self, placements: list[Placement], comm=None, dp_axis: str = "dp"):
        self.comm, self.dp_axis = comm, dp_axis
        size = (lambda a: comm.mesh.size(a)) if comm is not None else (lambda a: 1)
        coord = (lambda a: comm.mesh.rank(a)) if comm is not None else (lambda a: 0)
        self.D, self.T = size(dp_axis), size("tp")
        self.d, self.t = coord(dp_axis), coord("tp")
        grid = self._gather_placements(placements)  # {(d, t): [placement]}
        self.matrices = self._plan(grid)
        self.mine = [self.by_name[p.name] for p in placements]
        self.device = comm.mesh.device if comm is not None else torch.device("cpu")

    def _gather_placements(self, placements: list[Placement]) -> dict[tuple[int, int], list[Placement]]:
        def gather(obj, axis: str, n: int) -> list:
            if n == 1:
                return [obj]
            out = [None] * n
            dist.all_gather_object(out, obj, group=self.comm.mesh.group(axis))
            return out
        along_dp = gather(list(placements), self.dp_axis, self.D)
        both = gather(along_dp, "tp", self.T)
        return {(d, t): both[t][d] for t in range(self.T) for d in range(self.D)}

    def _plan(self, grid: dict[tuple[int, int], list[Placement]]) -> list[_Matrix]:
        shapes = {}
        for places in grid.values():
            for p in places:
                shapes[p.name] = p.global_shape
        order = sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n))
        n = self.D * self.T
        self.by_name = {name: _Matrix(name, shapes[name], divmod(k % n, self.T)) for k, name in enumerate(order)}
        for (d, t), places in grid.items():
            for p in places:
                m = self.by_name[p.name]
                if (d, t) in m.ranges:
                    raise ValueError(f"{p.name}: two pieces on one rank; a whole-matrix optimizer needs one")
                m.ranges[(d, t)] = p.flat_range
                m.boxes[t] = replace(p, flat_range=None, replicated_over=())
        for m in self.by_name.values():
            for t, box in m.boxes.items():
                if sum(s.numel() for s in box.segments()) != m.box_numel(t):
                    raise ValueError(f"{m.name}: a padded tp box; whole-matrix optimizers need unpadded matrices")
        return [self.by_name[name] for name in order]

    # ------------------------------------------------------------ one step

    def orthogonalise(self, updates: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        mine = {m.name: u.reshape(-1) for m, u in zip(self.mine, updates)}
        boxes = self._gather_boxes(mine)  # name -> my whole box, for matrices owned at my dp coordinate
        results = self._owned_results(boxes, fn)  # name -> my box of fn(matrix), same matrices
        out = self._scatter_ranges(results, {m.name: u.numel() for m, u in zip(self.mine, updates)})
        return [out[m.name].view_as(u) for m, u in zip(self.mine, updates)]

    def _exchange(self, axis: str, n: int, active: bool, sends: list[list[torch.Tensor]],
                  recv_sizes: list[list[int]], like: torch.Tensor) -> list[list[torch.Tensor]]:
        """One all_to_all_v over `axis`: sends[j] to member j (none to itself); returns the received parts.
        `active`: whether the group moves anything (the same on every member: it is read off the plan)."""
        out_splits = [sum(sizes) for sizes in recv_sizes]
        in_splits = [sum(t.numel() for t in parts) for parts in sends]
        received = [[] for _ in range(n)]
        if active and n > 1:
            total_out = sum(out_splits)
            flat_in = torch.cat([t.reshape(-1) for parts in sends for t in parts]) if sum(in_splits) else \
                like.new_zeros(0)
            flat_out = like.new_empty(total_out)
            self.comm.all_to_all_v(flat_out, flat_in, out_splits, in_splits, axis, tag="matrices")
            at = 0
            for j, sizes in enumerate(recv_sizes):
                for s in sizes:
                    received[j].append(flat_out[at: at + s])
                    at += s
        return received

    def _gather_boxes(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hops A and B of the gather: {name: my whole box} for the matrices owned at my dp coordinate,
        the owner's entry the whole matrix (flattened)."""
        d, t, like = self.d, self.t, torch.zeros(0, device=self.device)
        sends = [[] for _ in range(self.D)]
        recv = [[] for _ in range(self.D)]
        for m in self.matrices:
            if not m.sharded(t):
                continue
            if m.owner[0] != d:
                a, b = m.real(d, t)
                sends[m.owner[0]].append(mine[m.name][: b - a] if b > a else like)
            else:
                for j in range(self.D):
                    if j != d:
                        a, b = m.real(j, t)
                        recv[j].append(b - a)
        got = self._exchange(self.dp_axis, self.D, any(m.sharded(t) for m in self.matrices), sends, recv, like)
        boxes, taken = {}, [0] * self.D
        for m in self.matrices:
            if m.owner[0] != d:
                continue
            if not m.sharded(t):
                boxes[m.name] = mine[m.name][: m.box_numel(t)]
                continue
            box = like.new_zeros(m.box_numel(t))
            for j in range(self.D):
                a, b = m.real(j, t)
                if j != d:
                    box[a:b] = got[j][taken[j]]
                    taken[j] += 1
                elif b > a:
                    box[a:b] = mine[m.name][: b - a]
            boxes[m.name] = box
        return self._gather_matrices(boxes, like)

    def _gather_matrices(self, boxes: dict[str, torch.Tensor], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Hop B: the owner's tp coordinate receives the other boxes and assembles the matrix."""
        t = self.t
        owned = [m for m in self.matrices if m.owner[0] == self.d]
        sends = [[] for _ in range(self.T)]
        recv = [[] for _ in range(self.T)]
        for m in owned:
            if m.whole_box_at_owner():
                continue
            if m.owner[1] != t:
                sends[m.owner[1]].append(boxes[m.name])
            else:
                for j in range(self.T):
                    if j != t:
                        recv[j].append(m.box_numel(j))
        got = self._exchange("tp", self.T, any(not m.whole_box_at_owner() for m in owned), sends, recv, like)
        taken = [0] * self.T
        for m in owned:
            if m.owner[1] != t:
                continue
            if m.whole_box_at_owner():
                boxes[m.name] = boxes[m.name].view(m.shape)
                continue
            whole = like.new_empty(m.shape)
            for j in range(self.T):
                local = boxes[m.name] if j == t else got[j][taken[j]]
                taken[j] += j != t
                for seg in m.boxes[j].segments():
                    whole[_slices(seg)] = seg.view(local, m.boxes[j])
            boxes[m.name] = whole
        return boxes

    def _owned_results(self, boxes: dict[str, torch.Tensor], fn) -> dict[str, torch.Tensor]:
        """`fn` on the matrices this rank owns; hop B back: {name: my box of the result} at my dp coordinate."""
        t, like = self.t, torch.zeros(0, device=self.device)
        owned = [m for m in self.matrices if m.owner[0] == self.d]
        sends = [[] for _ in range(self.T)]
        recv = [[] for _ in range(self.T)]
        results = {}
        for m in owned:
            if m.owner[1] == t:
                whole = fn(boxes[m.name])
                for j in range(self.T):
                    local = like.new_empty(m.box_numel(j))
                    for seg in m.boxes[j].segments():
                        seg.view(local, m.boxes[j]).copy_(whole[_slices(seg)])
                    if j == t:
                        results[m.name] = local
                    else:
                        sends[j].append(local)
            else:
                recv[m.owner[1]].append(m.box_numel(t))
        got = self._exchange("tp", self.T, bool(owned), sends, recv, like)
        taken = [0] * self.T
        for m in owned:
            j = m.owner[1]
            if j != t:
                results[m.name] = got[j][taken[j]]
                taken[j] += 1
        return results

    def _scatter_ranges(self, results: dict[str, torch.Tensor], numels: dict[str, int]) -> dict[str, torch.Tensor]:
        """Hop A back: every dp rank's range (its whole box under plain dp) of the result, zero-padded to its piece."""
        d, t, like = self.d, self.t, torch.zeros(0, device=self.device)
        sends = [[] for _ in range(self.D)]
        recv = [[] for _ in range(self.D)]
        for m in self.matrices:
            if m.owner[0] == d:
                for j in range(self.D):
                    a, b = m.real(j, t)
                    if j != d and (j, t) in m.ranges:
                        sends[j].append(results[m.name][a:b])
            elif (d, t) in m.ranges:
                a, b = m.real(d, t)
                recv[m.owner[0]].append(b - a)
        active = any(tt == t for m in self.matrices for (_, tt) in m.ranges)
        got = self._exchange(self.dp_axis, self.D, active, sends, recv, like)
        out, taken = {}, [0] * self.D
        for m in self.matrices:
            if m.name not in numels:
                continue
            a, b = m.real(d, t)
            j = m.owner[0]
            part = results[m.name][a:b] if j == d else got[j][taken[j]]
            taken[j] += j != d
            piece = like.new_zeros(numels[m.name])
            piece[: b - a] = part
            out[m.name] = piece
        return out


def _slices(seg) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(seg.offsets, seg.shape))
