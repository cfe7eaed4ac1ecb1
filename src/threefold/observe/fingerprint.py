"""Collective-sequence fingerprint: catch ranks that issue different collectives before they hang.

Every member of a group must issue the group's collectives in the same order with the same
shapes; when one does not (a branch taken on one rank only, a tensor of another shape), NCCL
hangs or silently mixes data. This listener of `Comm` keeps, per mesh axis, a running CRC32 of
each call's (op, shape, dtype) and the number of calls. `check()` - run by the trainer every
`debug.fingerprint_every` steps at the same point of the step on every rank - all-gathers
(count, crc) over each axis (one all_gather of 2 int64 per axis, filed as "all_gather.fingerprint")
and raises `CollectiveMismatch` on every member when they differ, naming the ranks apart from
the majority and the first call where the sequences part.

Point-to-point calls are left out: a send on one rank is a receive on the other.
"""

from __future__ import annotations

import collections
import zlib

import torch

from ..comm import Comm

_P2P = ("send", "recv")


class CollectiveMismatch(RuntimeError):
    """Ranks of one group issued different sequences of collectives."""


class Fingerprint:
    def __init__(self, comm: Comm, keep: int = 4096):
        self.comm = comm
        self.state: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # axis -> [count, crc]
        # each call's crc since the last good check, to find where sequences part
        self.calls: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=keep))
        self.checks = 0
        comm.listeners.append(self.observe)

    def observe(self, record) -> None:
        if record.op in _P2P:
            return
        state = self.state[record.axis]
        signature = f"{record.op}|{record.shape}|{record.dtype}".encode()
        state[0] += 1
        state[1] = zlib.crc32(signature, state[1])
        self.calls[record.axis].append((zlib.crc32(signature), record.op, record.shape, record.dtype, record.callsite))

    def close(self) -> None:
        if self.observe in self.comm.listeners:
            self.comm.listeners.remove(self.observe)

    def check(self, step: int) -> None:
        mesh = self.comm.mesh
        self.checks += 1
        for axis in reversed(mesh.axis_names):
            n = mesh.size(axis)
            if n == 1:
                continue
            count, crc = self.state[axis]  # before the check's own all_gather is counted
            mine = torch.tensor([count, crc], dtype=torch.int64, device=mesh.device)
            gathered = torch.empty(n * 2, dtype=torch.int64, device=mesh.device)
            self.comm.all_gather(gathered, mine, axis, tag="fingerprint")
            rows = [tuple(row) for row in gathered.view(n, 2).tolist()]
            if len(set(rows)) > 1:
                self._mismatch(axis, step, rows)
            self.calls[axis].clear()  # the sequences agree up to here

    def _mismatch(self, axis: str, step: int, rows: list[tuple]) -> None:
        mesh = self.comm.mesh
        ranks = mesh.ranks(axis)
        majority = collections.Counter(rows).most_common(1)[0][0]
        apart = [ranks[i] for i, row in enumerate(rows) if row != majority]
        first, detail = self._first_difference(axis)
        counts = ", ".join(f"rank {ranks[i]}: {c} calls" for i, (c, _) in enumerate(rows))
        raise CollectiveMismatch(
            f"ranks of the {axis} group {list(ranks)} issued different collectives by step {step}: "
            f"rank{'s' if len(apart) > 1 else ''} {','.join(map(str, apart))} differ from the others ({counts}); "
            f"first difference at {axis} call #{first} since the last check: {detail}")

    def _first_difference(self, axis: str) -> tuple[int, str]:
        """Where this rank's calls since the last good check part from the others' (one more all_gather)."""
        mesh = self.comm.mesh
        n = mesh.size(axis)
        mine = list(self.calls[axis])[:-1]  # without the check's all_gather itself
        length = torch.tensor([len(mine)], dtype=torch.int64, device=mesh.device)
        lengths = torch.empty(n, dtype=torch.int64, device=mesh.device)
        self.comm.all_gather(lengths, length, axis, tag="fingerprint")
        width = int(lengths.max())
        crcs = torch.full((width,), -1, dtype=torch.int64, device=mesh.device)
        if mine:
            crcs[:len(mine)] = torch.tensor([c[0] for c in mine], dtype=torch.int64)
        gathered = torch.empty(n * width, dtype=torch.int64, device=mesh.device)
        if width:
            self.comm.all_gather(gathered, crcs, axis, tag="fingerprint")
        table = gathered.view(n, width).tolist() if width else [[] for _ in range(n)]
        index = next((i for i in range(width) if len({row[i] for row in table}) > 1), width)
        me = mesh.rank(axis)
        if index < len(mine):
            _, op, shape, dtype, callsite = mine[index]
            return index + 1, (f"this rank ({mesh.global_rank}) issued {op} shape {list(shape)} {dtype} "
                               f"at {callsite}")
        return index + 1, f"this rank ({mesh.global_rank}) issued no call there ({lengths[me].item()} calls)"
