"""PowerSGD (Vogels et al. 2019): each gradient matrix sent as a rank-r product P Q^T.

Per bucket, for every matrix M (m x n; a parameter of dim >= 2 viewed as shape[0] x rest)
for which r (m + n) < m n, on each rank (M = local gradient + error when error feedback is on):

    P = M Q                     Q from the previous step (warm start; random at the start,
                                the same on every rank)
    all-reduce P                (sum, with the bucket's vectors and small matrices, uncompressed)
    P = orthonormal basis of P  (reduced QR: every rank computes the same)
    Q_i = M^T P ;  error = M - P Q_i^T   (what the rank-r projection of M missed, kept locally)
    all-reduce Q                (sum)
    gradient = P Q^T            (= P P^T sum_i M_i, the projection of the summed gradient)

One power-iteration step per training step; the warm start makes successive steps refine the
same subspace. Bytes per rank and matrix: the ring all-reduce of r (m + n) values instead of
m n. The first `warmup_steps` steps are sent uncompressed (as PyTorch's start_powerSGD_iter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import Comm
from ..hierarchical import dense_all_reduce
from .hook import StatelessHook


@dataclass(frozen=True)
class _Matrix:
    offset: int  # in the bucket
    rows: int
    cols: int
    p_offset: int  # in the flat P buffer
    q_offset: int  # in the flat Q buffer


class _Layout:
    """Which parts of a bucket are compressed (matrices) and which are sent as they are."""

    def __init__(self, bucket, rank: int):
        self.rank = rank
        self.matrices: list[_Matrix] = []
        self.dense: list[tuple[int, int]] = []  # (offset, numel)
        p_total = q_total = 0
        for param, offset in zip(bucket.params, bucket.offsets):
            rows = param.shape[0] if param.dim() >= 2 else 0
            cols = param.numel() // rows if rows else 0
            if rows and rank * (rows + cols) < rows * cols:
                self.matrices.append(_Matrix(offset, rows, cols, p_total, q_total))
                p_total += rows * rank
                q_total += cols * rank
            else:
                self.dense.append((offset, param.numel()))
        self.p_numel, self.q_numel = p_total, q_total
        self.dense_numel = sum(n for _, n in self.dense)


class PowerSGDHook(StatelessHook):
    def __init__(self, rank: int = 4, warmup_steps: int = 0, error_feedback: bool = True, seed: int = 0,
                 hierarchical: bool = False):
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.error_feedback = error_feedback
        self.seed = seed
        self.hierarchical = hierarchical
        self._layouts: dict[int, _Layout] = {}

    def _layout(self, bucket) -> _Layout:
        if bucket.index not in self._layouts:
            self._layouts[bucket.index] = _Layout(bucket, self.rank)
        return self._layouts[bucket.index]

    def _init_state(self, bucket, layout: _Layout) -> dict:
        state = bucket.state
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.int64)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket.index)  # same Q on every rank
            state["q"] = torch.randn(layout.q_numel, generator=gen).to(bucket.buffer)
            if self.error_feedback:
                state["error"] = torch.zeros_like(bucket.buffer)
        if "q" not in state and not layout.q_numel:  # no matrix compressed: the empty Q a checkpoint does not hold
            state["q"] = bucket.buffer.new_empty(0)
        return state

    def _matrix(self, flat: torch.Tensor, mat: _Matrix) -> torch.Tensor:
        return flat[mat.offset: mat.offset + mat.rows * mat.cols].view(mat.rows, mat.cols)

    def launch(self, bucket, comm: Comm, axis: str):
        layout = self._layout(bucket)
        state = self._init_state(bucket, layout)
        state["_comm"] = (comm, axis)
        if int(state["step"]) < self.warmup_steps:
            state["_dense"] = True
            return dense_all_reduce(comm, bucket.buffer, axis, self.hierarchical, async_op=True)
        grads = bucket.buffer
        if self.error_feedback:
            grads.add_(state["error"])  # M = gradient + what earlier steps did not send
        send = state["_send"] = torch.empty(layout.p_numel + layout.dense_numel, dtype=grads.dtype,
                                            device=grads.device)
        r = self.rank
        for mat in layout.matrices:
            q = state["q"][mat.q_offset: mat.q_offset + mat.cols * r].view(mat.cols, r)
            torch.matmul(self._matrix(grads, mat), q, out=send[mat.p_offset: mat.p_offset + mat.rows * r]
                         .view(mat.rows, r))
        at = layout.p_numel
        for offset, numel in layout.dense:
            send[at: at + numel] = grads[offset: offset + numel]
            at += numel
        return dense_all_reduce(comm, send, axis, self.hierarchical, async_op=True)

    def complete(self, bucket) -> None:
        state = bucket.state
        comm, axis = state.pop("_comm")
        if state.pop("_dense", False):
            state["step"] += 1
            return
        layout, r = self._layout(bucket), self.rank
        grads, send = bucket.buffer, state.pop("_send")
        q_all = torch.empty_like(state["q"])
        bases = []
        for mat in layout.matrices:
            p = _orthonormal(send[mat.p_offset: mat.p_offset + mat.rows * r].view(mat.rows, r))
            m = self._matrix(grads, mat)
            q_local = q_all[mat.q_offset: mat.q_offset + mat.cols * r].view(mat.cols, r)
            torch.matmul(m.t(), p, out=q_local)
            if self.error_feedback:
                self._matrix(state["error"], mat).copy_(m - p @ q_local.t())
            bases.append(p)
        if q_all.numel():
            dense_all_reduce(comm, q_all, axis, self.hierarchical)
        for mat, p in zip(layout.matrices, bases):
            q = q_all[mat.q_offset: mat.q_offset + mat.cols * r].view(mat.cols, r)
            torch.matmul(p, q.t(), out=self._matrix(grads, mat))
        at = layout.p_numel
        for offset, numel in layout.dense:
            grads[offset: offset + numel] = send[at: at + numel]
            at += numel
        state["q"] = q_all  # warm start of the next step
        state["step"] += 1


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Q of the QR decomposition of `p`, in fp32 when `p` is 16-bit (CPU has no 16-bit QR)."""
    if p.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(p.float()).Q.to(p.dtype)
    return torch.linalg.qr(p).Q
