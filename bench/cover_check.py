"""Time of the checkpoint manifest's exact cover check (`first_overlap`) on the slices real
layouts write: ZeRO flat shards over many dp ranks, tp column blocks cut again by ZeRO, and a
3-d stacked expert tensor. Each box set is a true tiling (the check finds no overlap); then one
box is replaced by a copy of its neighbour (a hole and a duplicate) and must be caught.

    python bench/cover_check.py
"""

from __future__ import annotations

import math
import time

from tests.checkpoint_layouts import tp_split, zero_shard
from threefold.checkpoint.format import first_overlap
from threefold.checkpoint.pieces import local_pieces

CASES = [("ZeRO [50304, 4096] dp=1024", (50304, 4096), 0, 1, 1024),
         ("ZeRO [50304, 4096] dp=4096", (50304, 4096), 0, 1, 4096),
         ("tp=8 columns x ZeRO [4096, 4096] dp=512", (4096, 4096), 1, 8, 512),
         ("tp=8 columns x ZeRO [4096, 4096] dp=2048", (4096, 4096), 1, 8, 2048),
         ("tp=8 x ZeRO [64, 1024, 4096] dp=512", (64, 1024, 4096), 2, 8, 512),
         ("tp=8 x ZeRO [64, 1024, 4096] dp=2048", (64, 1024, 4096), 2, 8, 2048)]


def boxes(shape, tp_dim, tp, dp):
    parts = tp_split("t", shape, tp_dim, tp, math.ceil(shape[tp_dim] / tp) * tp)
    return [p.box for part in parts for shard in zero_shard(part, dp) for p in local_pieces(shard)
            if math.prod(p.shape)]


def main() -> None:
    for label, shape, tp_dim, tp, dp in CASES:
        found = boxes(shape, tp_dim, tp, dp)
        start = time.perf_counter()
        assert first_overlap(shape, found) is None
        elapsed = time.perf_counter() - start
        broken = list(found)
        broken[len(found) // 2] = found[len(found) // 2 + 1]
        assert first_overlap(shape, broken) is not None
        print(f"{label}: {len(found)} boxes, {elapsed * 1000:.0f} ms")


if __name__ == "__main__":
    main()
