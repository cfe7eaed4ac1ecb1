"""An all-pairs (pairwise) covering array over the options that compose, with the rules that
make a combination invalid. Written out here, not imported from the library: the test checks
that the library's config validation rejects exactly these and that every valid case trains.

`FACTORS` are the options; `invalid(case)` returns the config key that must be named in the
error for a case that cannot run, or None. `covering()` greedily builds valid cases until
every pair of option values that can occur together in some valid case occurs in one;
`invalid_pairs()` are the pairs that can occur in no valid case: each is a config error.
"""

from __future__ import annotations

import functools
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
    # the optimizer states of this rank's ZeRO shard in host memory, or in files (parallel/nvme.py)
    "offload": ("none", "optimizer", "nvme"),
    # LoRA adapters on a Hugging Face Llama (the base frozen), or the reference decoder trained whole
    "lora": (False, True),
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
    if case["offload"] != "none" and case["zero"] == 0:
        return "parallel.offload"
    if case["zero"] >= 1 and case["compress"] in SPARSE:
        return "compress.method"
    if case["lora"] and case["sp"] and case["tp"] > 1:  # the adapters are not split over the sequence
        return "model.lora_rank"
    return None


@functools.cache
def _table() -> tuple[list[dict], torch.Tensor, list[bool]]:
    """Every case, its pairs as ids (one column per pair of factors) and whether it is valid."""
    names = list(FACTORS)
    sizes = [len(v) for v in FACTORS.values()]
    index = torch.cartesian_prod(*(torch.arange(s) for s in sizes))  # case x factor: value indices
    columns, offset = [], 0
    for i, j in itertools.combinations(range(len(names)), 2):
        columns.append(offset + index[:, i] * sizes[j] + index[:, j])
        offset += sizes[i] * sizes[j]
    cases = [dict(zip(names, values)) for values in itertools.product(*FACTORS.values())]
    return cases, torch.stack(columns, 1), [invalid(c) is None for c in cases]


def _pair_of(pair_id: int) -> tuple:
    """((factor, value), (factor, value)) of a pair id of `_table`."""
    names = list(FACTORS)
    for i, j in itertools.combinations(range(len(names)), 2):
        block = len(FACTORS[names[i]]) * len(FACTORS[names[j]])
        if pair_id < block:
            a, b = divmod(pair_id, len(FACTORS[names[j]]))
            return (names[i], FACTORS[names[i]][a]), (names[j], FACTORS[names[j]][b])
        pair_id -= block
    raise IndexError(pair_id)


def covering() -> list[dict]:
    """Valid cases covering every pair that some valid case contains (greedy, deterministic)."""
    cases, pairs, ok = _table()
    valid = torch.tensor(ok).nonzero().flatten()
    rows = pairs[valid]
    uncovered = torch.zeros(int(pairs.max()) + 1, dtype=torch.int32)
    uncovered[rows.flatten()] = 1
    chosen = []
    while uncovered.any():
        best = int(torch.argmax(uncovered[rows].sum(1)))  # the first of the cases covering the most
        chosen.append(cases[int(valid[best])])
        uncovered[rows[best]] = 0
    return chosen


def invalid_pairs() -> list[tuple]:
    """Pairs of option values that no valid case contains."""
    _, pairs, ok = _table()
    seen = set(pairs[torch.tensor(ok)].flatten().tolist())
    return sorted((_pair_of(p) for p in range(int(pairs.max()) + 1) if p not in seen), key=str)


def case_with(pair: tuple) -> dict:
    """A case holding `pair`, the rest chosen so that only the pair itself is at fault."""
    (fa, va), (fb, vb) = pair
    for c in _table()[0]:
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


def model(case: dict, llama: str) -> list[str]:
    """The model of the case: the reference decoder (4 layers), or LoRA (rank 4) on the Llama saved in `llama`."""
    if case["lora"]:
        return [f"model.preset=hf:{llama}", "model.lora_rank=4", "model.lora_alpha=8"]
    return ["model.preset=tiny", "model.layers=4"]


def overrides(case: dict, scratch: str = "scratch") -> list[str]:
    """The case as config overrides (2 micro-batches; `scratch`: the NVMe offload's directory); the
    model is `model`'s, when and what it saves and resumes is the test's."""
    out = [f"parallel.dp={case['dp']}", f"parallel.tp={case['tp']}", f"parallel.pp={pp_size(case)}",
           f"parallel.sequence_parallel={str(case['sp']).lower()}", f"parallel.zero={case['zero']}",
           f"remat.policy={case['remat']}", f"precision.compute={case['precision']}",
           f"compress.method={case['compress']}", f"parallel.offload={case['offload']}"]
    if case["offload"] == "nvme":
        out.append(f"parallel.offload_dir={scratch}")
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
    if case["compress"] == "dgc":  # every entry sent: the dense sum of bf16 values (the test's reference)
        out += ["compress.dgc_sparsity=0", "compress.dgc_local_clip=false"]
    return out


def label(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())
