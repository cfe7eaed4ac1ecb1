"""An all-pairs (pairwise) covering array over the options that compose, with the rules that
make a combination invalid. Written out here, not imported from the library: the test checks
that the library's config validation rejects exactly these and that every valid case trains.

`FACTORS` are the options; `invalid(case)` returns the config key that must be named in the
error for a case that cannot run, or None. `covering()` greedily builds valid cases until
every pair of option values that can occur together in some valid case occurs in one;
`invalid_pairs()` are the pairs that can occur in no valid case: each is a config error.
"""

from __future__ import annotations

import itertools

import torch

WORLD = 4
FACTORS: dict[str, tuple] = {
    "dp": (1, 2, 4),
    "tp": (1, 2),
    "pp": ("none", "gpipe", "1f1b", "interleaved", "zb-h1"),  # pp=2 under that schedule, or pp=1
    "sp": (False, True),
    "zero": (0, 1, 2, 3),
    "remat": ("none", "full", "selective", "every-k"),
    "precision": ("fp32", "bf16", "fp16"),
    "compress": ("none", "bf16", "powersgd", "dgc"),
    "offload": (False, True),
    # every case saves; then resumes from its first checkpoint under the same layout (saved
    # synchronously, asynchronously, or read back from the peer keepers' memory), or under another
    # layout (one process) from a synchronous save
    "checkpoint": ("sync", "async", "peer", "relayout"),
}
SPARSE = ("powersgd", "dgc")  # replace the all-reduce of plain data parallelism


def pp_size(case: dict) -> int:
    return 1 if case["pp"] == "none" else 2


def invalid(case: dict) -> str | None:
    """The config key whose error rejects `case`, or None when it is a valid run."""
    if case["dp"] * case["tp"] * pp_size(case) != WORLD:
        return "parallel"
    if case["offload"] and case["zero"] == 0:
        return "parallel.offload"
    if case["zero"] >= 1 and case["compress"] in SPARSE:
        return "compress.method"
    return None


def _all_cases() -> list[dict]:
    names = list(FACTORS)
    return [dict(zip(names, values)) for values in itertools.product(*FACTORS.values())]


def _pairs(case: dict) -> list[tuple]:
    items = list(case.items())
    return [(a, b) for a, b in itertools.combinations(items, 2)]


def covering() -> list[dict]:
    """Valid cases covering every pair that some valid case contains (greedy, deterministic)."""
    valid = [c for c in _all_cases() if invalid(c) is None]
    index: dict[tuple, int] = {}
    rows = [[index.setdefault(p, len(index)) for p in _pairs(c)] for c in valid]
    incidence = torch.zeros(len(valid), len(index))
    for i, row in enumerate(rows):
        incidence[i, row] = 1.0
    uncovered = torch.ones(len(index))
    chosen = []
    while uncovered.any():
        best = int(torch.argmax(incidence @ uncovered))  # the first of the cases covering the most
        chosen.append(valid[best])
        uncovered[rows[best]] = 0.0
    return chosen


def invalid_pairs() -> list[tuple]:
    """Pairs of option values that no valid case contains."""
    seen = {p for c in _all_cases() if invalid(c) is None for p in _pairs(c)}
    everything = {p for c in _all_cases() for p in _pairs(c)}
    return sorted(everything - seen, key=str)


def case_with(pair: tuple) -> dict:
    """A case holding `pair`, the rest chosen so that only the pair itself is at fault."""
    (fa, va), (fb, vb) = pair
    for c in _all_cases():
        if c[fa] == va and c[fb] == vb and invalid(_without(c, pair)) is None:
            return c
    raise AssertionError(f"no case isolates {pair}")


def _without(case: dict, pair: tuple) -> dict:
    """`case` with the pair's values replaced by ones forming a valid case (if the rest allows)."""
    (fa, _), (fb, _) = pair
    for va, vb in itertools.product(FACTORS[fa], FACTORS[fb]):
        c = {**case, fa: va, fb: vb}
        if invalid(c) is None:
            return c
    return case


def overrides(case: dict) -> list[str]:
    """The case as config overrides (tiny model, 4 layers, 2 micro-batches); when and what it saves
    and resumes is the test's."""
    out = [f"parallel.dp={case['dp']}", f"parallel.tp={case['tp']}", f"parallel.pp={pp_size(case)}",
           f"parallel.sequence_parallel={str(case['sp']).lower()}", f"parallel.zero={case['zero']}",
           f"remat.policy={case['remat']}", f"precision.compute={case['precision']}",
           f"compress.method={case['compress']}",
           f"parallel.offload={'optimizer' if case['offload'] else 'none'}"]
    if case["checkpoint"] == "async":
        out.append("checkpoint.async_save=true")
    if case["checkpoint"] == "peer":
        out.append("checkpoint.peer_copy=true")
    if case["pp"] != "none":
        out.append(f"pipeline.schedule={case['pp']}")
    if case["pp"] == "interleaved":
        out.append("pipeline.virtual_stages=2")
    if case["compress"] in ("onebit", "powersgd"):
        out.append("compress.warmup_steps=1")
    return out


def label(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())
