"""PipeDream-2BW's timeline as data (pure Python, read by the schedule registry): 1F1B across
batches without a flush, each stage's update U right after its last backward of a batch.
The runtime side (weight versions, the per-step pieces) is pipeline/two_bw.py."""

from __future__ import annotations

from .actions import Action

NAME = "pipedream-2bw"
UPDATE = "U"  # the stage's optimizer step with the batch's accumulated gradient (mb: the batch's last)
SHOWN = 2  # batches in the timeline `build_schedule` returns (pictures, simulator, validator)


def check_request(p: int, m: int) -> None:
    if m < p:
        raise ValueError(f"{NAME} needs at least as many micro-batches as pipeline ranks ({m} < {p}): with fewer, a "
                         f"third weight version would be in flight; raise microbatches to {p} or more")


def unrolled_orders(p: int, m: int, batches: int, updates: bool = True) -> list[list[Action]]:
    """Each rank's compute order over `batches` batches without flush: 1F1B over batches * m
    micro-batches (micro-batch i of batch b is b * m + i), U(b) right after b's last backward."""
    check_request(p, m)
    total = batches * m
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, total)
        seq = [Action("F", r, i) for i in range(warmup)]
        for i in range(warmup, total):
            seq += [Action("F", r, i), Action("B", r, i - warmup)]
        seq += [Action("B", r, i) for i in range(total - warmup, total)]
        order = []
        for a in seq:
            order.append(a)
            if updates and a.kind == "B" and a.mb % m == m - 1:
                order.append(Action(UPDATE, r, a.mb))
        orders.append(order)
    return orders


def shown_order(p: int, m: int, rank: int) -> list[Action]:
    """The compute order `build_schedule` shows for pipedream-2bw: SHOWN batches without flush
    (updates left out: they are not in the shared vocabulary; `unrolled` has them)."""
    return unrolled_orders(p, m, SHOWN, updates=False)[rank]
