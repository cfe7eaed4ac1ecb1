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
import math

import torch

WORLD = 4
FACTORS: dict[str, tuple] = {
    "dp": (1, 2, 4),
    "tp": (1, 2),
    "pp": ("none", "gpipe", "1f1b", "interleaved", "zb-h1"),  # pp=2 under that schedule, or pp=1
    "sp": (False, True),
    "zero": (0, 1, 2, 3),
    "remat": ("none", "full", "selective", "every-k"),
    # mxfp8: the blocks' linears (every one, the experts' too) in MXFP8 blocks of 32, emulated off Blackwell
    "precision": ("fp32", "bf16", "fp16", "mxfp8"),
    "compress": ("none", "bf16", "powersgd", "dgc"),
    # the optimizer states of this rank's ZeRO shard in host memory, or in files (parallel/nvme.py)
    "offload": ("none", "optimizer", "nvme"),
    # LoRA adapters on a Hugging Face Llama (the base frozen), or the reference decoder trained whole
    "lora": (False, True),
    # every case saves; then resumes from its first checkpoint under the same layout (saved
    # synchronously, asynchronously, or read back from the peer keepers' memory), or under another
    # layout (one process) from a synchronous save
    "checkpoint": ("sync", "async", "peer", "relayout"),
    "optimizer": ("adamw", "muon"),
    # multi-token prediction: one extra depth (model.mtp_depth=1), its loss weighted by model.mtp_weight
    "mtp": (0, 1),
    # the reference decoder's blocks as mixtures of experts (dropless top-2 of 4, ep=1), balanced by
    # the auxiliary loss or by DeepSeek-V3's per-expert bias (model.router_balance); or dense
    "moe": ("none", "aux", "bias"),
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
    if case["lora"] and case["moe"] != "none":  # LoRA on a Hugging Face mixture of experts
        return "model.lora_rank"
    if case["lora"] and case["sp"] and case["tp"] > 1:  # the adapters are not split over the sequence
        return "model.lora_rank"
    # the depths are threefold's own decoder's (not a Hugging Face model's), and a row's last position
    # cannot be left out when tp ranks hold parts of the sequence
    if case["mtp"] and (case["lora"] or case["sp"] and case["tp"] > 1):
        return "model.mtp_depth"
    if case["optimizer"] == "muon":  # what its whole-matrix exchange does not serve
        if case["lora"]:
            return "model.lora_rank"
        if case["moe"] != "none":
            return "model.experts"
        if case["offload"] != "none":
            return "parallel.offload"
        if case["compress"] in SPARSE:
            return "compress.method"
    return None


class _Unread(Exception):
    """`invalid` read a factor that the partial case holds no value of yet."""


class _Partial(dict):
    """A case whose factors are given values only as `invalid` reads them (with `case[name]`)."""

    def __missing__(self, name: str):
        raise _Unread(name)


def _valid_cases() -> torch.Tensor:
    """Every valid case as value indices (case x factor), in the order of itertools.product over FACTORS.
    `invalid` decides partial cases, a factor taking each of its values in turn when it is read: a partial
    case's answer holds for every case extending it, so the product is never listed whole."""
    names, sizes = list(FACTORS), [len(v) for v in FACTORS.values()]
    blocks = []

    def explore(fixed: dict[str, int]) -> None:
        try:
            wrong = invalid(_Partial({name: FACTORS[name][i] for name, i in fixed.items()}))
        except _Unread as read:
            for i in range(len(FACTORS[read.args[0]])):
                explore({**fixed, read.args[0]: i})
            return
        if wrong is None:
            blocks.append(torch.cartesian_prod(*(torch.tensor([fixed[n]]) if n in fixed else torch.arange(size)
                                                 for n, size in zip(names, sizes))))

    explore({})
    index = torch.cat(blocks)
    return index[(index @ _strides()).argsort()]


def _strides() -> torch.Tensor:
    """Value indices (case x factor) @ _strides(): the case's place in the order of the product."""
    sizes = [len(v) for v in FACTORS.values()]
    return torch.tensor([math.prod(sizes[i + 1:]) for i in range(len(sizes))])


@functools.cache
def _table() -> tuple[torch.Tensor, torch.Tensor, int]:
    """The valid cases (value indices), their pairs as ids (one column per pair of factors) and the number of
    pair ids."""
    sizes = [len(v) for v in FACTORS.values()]
    index = _valid_cases()
    columns, offset = [], 0
    for i, j in itertools.combinations(range(len(sizes)), 2):
        columns.append((offset + index[:, i] * sizes[j] + index[:, j]).int())
        offset += sizes[i] * sizes[j]
    return index, torch.stack(columns, 1), offset


def _case(values: torch.Tensor) -> dict:
    """The case of a row of value indices."""
    return {name: FACTORS[name][int(i)] for name, i in zip(FACTORS, values)}


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
    index, rows, count = _table()
    uncovered = torch.zeros(count, 1)
    uncovered[rows.flatten()] = 1
    chosen = []
    while uncovered.any():
        # the uncovered pairs of each case (uncovered[rows].sum(1), summed without the (cases x pairs) copy)
        best = int(torch.argmax(torch.nn.functional.embedding_bag(rows, uncovered, mode="sum")))  # the first best
        chosen.append(_case(index[best]))
        uncovered[rows[best]] = 0
    return chosen


def invalid_pairs() -> list[tuple]:
    """Pairs of option values that no valid case contains."""
    _, pairs, count = _table()
    seen = set(pairs.unique().tolist())
    return sorted((_pair_of(p) for p in range(count) if p not in seen), key=str)


def case_with(pair: tuple) -> dict:
    """A case holding `pair`, the rest chosen so that only the pair itself is at fault: the first in the order
    of the product that is a valid case but for the pair's two factors."""
    (fa, va), (fb, vb) = pair
    index, _, _ = _table()
    names = list(FACTORS)
    rows = index.clone()
    rows[:, names.index(fa)] = FACTORS[fa].index(va)
    rows[:, names.index(fb)] = FACTORS[fb].index(vb)
    if not len(rows):
        raise AssertionError(f"no case isolates {pair}")
    return _case(rows[int((rows @ _strides()).argmin())])


def _without(case: dict, pair: tuple) -> dict:
    """`case` with the pair's values replaced by ones forming a valid case (if the rest allows)."""
    (fa, _), (fb, _) = pair
    for va, vb in itertools.product(FACTORS[fa], FACTORS[fb]):
        c = {**case, fa: va, fb: vb}
        if invalid(c) is None:
            return c
    return case


def model(case: dict, hf: dict[str, str]) -> list[str]:
    """The model of the case: the reference decoder (4 layers of width 64: whole 32-element MXFP8 blocks
    on each tp rank), dense or of experts, with one MTP depth where the case has one; or LoRA (rank 4) on
    the Hugging Face model saved in `hf` (a Llama, or a Mixtral where the case has experts)."""
    out = ["model.mtp_depth=1", "model.mtp_weight=0.5"] if case["mtp"] else []
    if case["lora"]:
        return [f"model.preset=hf:{hf['mixtral' if case['moe'] != 'none' else 'llama']}", "model.lora_rank=4",
                "model.lora_alpha=8", *out]
    if case["moe"] == "none":
        return ["model.preset=tiny", "model.layers=4", "model.hidden=64", *out]
    out = ["model.preset=tiny-moe", "model.layers=4", "model.hidden=64", "model.kv_heads=4", "model.ffn_hidden=128",
           "model.expert_ffn_hidden=64", f"model.router_balance={case['moe']}", *out]
    return out + (["model.router_bias_rate=0.01"] if case["moe"] == "bias" else [])


def training(case: dict) -> list[str]:
    """What the case trains with beside the model, which its one-process reference shares: the precision
    (mxfp8: every block linear converted, as CPUs gain nothing) and the optimizer."""
    out = [f"precision.compute={case['precision']}", f"train.optimizer={case['optimizer']}"]
    if case["precision"] == "mxfp8":
        out += ["precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]
    return out


def reference(case: dict) -> tuple:
    """What a one-process run must share with the case to be its reference."""
    return case["precision"], case["optimizer"], case["lora"], case["moe"], case["mtp"]


def overrides(case: dict, scratch: str = "scratch") -> list[str]:
    """The case as config overrides (2 micro-batches; `scratch`: the NVMe offload's directory), `training`'s
    among them; the model is `model`'s, when and what it saves and resumes is the test's."""
    out = [f"parallel.dp={case['dp']}", f"parallel.tp={case['tp']}", f"parallel.pp={pp_size(case)}",
           f"parallel.sequence_parallel={str(case['sp']).lower()}", f"parallel.zero={case['zero']}",
           f"remat.policy={case['remat']}", f"compress.method={case['compress']}",
           f"parallel.offload={case['offload']}", *training(case)]
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
