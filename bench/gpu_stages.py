"""The stages of `bench/gpu.sh`: their order of value, the call each belongs to, the packages each
needs, and each one's estimated time on one H100 with cold caches (no torch import: gpu.sh reads
this before anything starts, in a tenth of a second).

    python bench/gpu_stages.py shell   NAME<TAB>CALL<TAB>ESTIMATE_S<TAB>MISSING per stage, then SEND<TAB>line
    python bench/gpu_stages.py table   the estimates as the markdown table of docs/gpu.md

**How a stage's time is estimated** (`estimate`): start-up + compilation + compute + fixed extras,
each from the stage's work, with these assumptions (an H100 SXM, nothing cached):

* start-up: `START_S` for a Python process that imports torch and threefold and creates its CUDA
  context, `LAUNCH_S` more for `threefold train --nproc 1` (the launcher's process, its worker's own
  imports, NCCL's communicator);
* compilation (inductor, cold caches): `REGION_S` per compiled region of threefold's per-block compile
  (embedding, one graph shared by every block, final norm, head, loss: 5 regions, forward and
  backward), and for the plain loop's whole-model compile `WHOLE_S` plus `WHOLE_PER_LAYER_S` per
  block (dynamo unrolls the blocks into one graph);
* compute: the stage's FLOPs (6 N + 12 L h s per token, every step of every side, warm-up and
  profile included) over `PEAK` x `MFU` (dense bf16 peak times an assumed 30% MFU).

The first GPU run records each stage's measured seconds beside its estimate (results.json `estimates`,
`status`), so the constants can be corrected from it.
"""

from __future__ import annotations

import importlib.util
import sys

PEAK, MFU = 989e12, 0.30
START_S, LAUNCH_S, REGION_S, WHOLE_S, WHOLE_PER_LAYER_S = 12, 15, 12, 10, 3
THREEFOLD_COMPILE_S = 5 * REGION_S

# shapes: (hidden, layers, ffn, vocab, kv heads / heads, tied, max positions, glu)
GPT2 = dict(hidden=768, layers=12, ffn=3072, vocab=50304, kv=1.0, tie=True, pos=1024, glu=False)
LLAMA_1B = dict(hidden=2048, layers=16, ffn=8192, vocab=128256, kv=0.25, tie=True, pos=0, glu=True)
LLAMA_7B_4 = dict(hidden=4096, layers=4, ffn=11008, vocab=32000, kv=1.0, tie=False, pos=0, glu=True)


def parameters(s: dict) -> float:
    """N of a decoder shape: embeddings, per block attention (q, o and the k, v of the kv heads) and MLP."""
    h = s["hidden"]
    block = h * h * (2 + 2 * s["kv"]) + h * s["ffn"] * (3 if s["glu"] else 2)
    return s["vocab"] * h * (1 if s["tie"] else 2) + s["pos"] * h + s["layers"] * block


def step_flops(s: dict, tokens: int, seq: int) -> float:
    return tokens * (6 * parameters(s) + 12 * s["layers"] * s["hidden"] * seq)


def whole_compile_s(s: dict) -> float:
    return WHOLE_S + WHOLE_PER_LAYER_S * s["layers"]


# the planner-kernels layers (bench/planner_kernels.py): (hidden, ffn, glu, kv, tp, tokens) -> 3 GEMMs of each
# of the four linears on one tp rank, and causal attention forward + backward, 20 repeats + a warm-up
PLANNER_LAYERS = [(2048, 8192, False, 1.0, 1, 4096), (4096, 16384, False, 1.0, 2, 4096),
                  (7168, 28672, False, 1.0, 8, 4096), (16384, 65536, False, 1.0, 8, 4096),
                  (12288, 49152, False, 1.0, 8, 2048), (4096, 14336, True, 0.25, 1, 8192),
                  (16384, 53248, True, 0.0625, 8, 8192)]


def planner_flops() -> float:
    total = 0.0
    for h, ffn, glu, kv, tp, tokens in PLANNER_LAYERS:
        weights = (h * h * (2 + 2 * kv) + h * ffn * (3 if glu else 2)) / tp
        total += 6 * tokens * weights + 6 * tokens * tokens * h / tp
    return 21 * total


# fp8-gemm's grid (bench/fp8_gemm.py GRID): forward + backward of one linear, bf16 and fp8, 21 calls each
FP8_FLOPS = 2 * 21 * sum(6 * m * k * n for m in (1024, 4096, 16384) for k, n in (
    (768, 768), (2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336), (8192, 8192)))


def stage_rows() -> list[tuple]:
    """(name, call, start_s, compile_s, flops, extra_s, needs, what), in the order the stages run: by value.
    Call 1 (`bash bench/gpu.sh`) holds every stage that answers a question of the issue the GPU hour is
    for; call 2 (`--only call2`) the rest. A stage that reads another's output is in the same call."""
    tiny = START_S + 3  # a tiny threefold run: a few eager steps of a 2-block model
    gpt2_cmp = 2 * (3 + 4 * 10 + 3) * step_flops(GPT2, 16 * 1024, 1024)
    llama_cmp = 2 * (3 + 3 * 5) * step_flops(LLAMA_1B, 4 * 2048, 2048)
    fp8_run = 12 * step_flops(LLAMA_7B_4, 2 * 2048, 2048)
    return [
        ("preflight", 1, START_S, 15, 0, 2, (), "versions, packages, device memory, one tiny inductor compile"),
        ("gpt2-compare", 1, START_S, THREEFOLD_COMPILE_S + whole_compile_s(GPT2), gpt2_cmp, 5, (),
         "GPT-2 124M: threefold against the plain loop, MFU of each"),
        ("llama-compare", 1, START_S, THREEFOLD_COMPILE_S + whole_compile_s(LLAMA_1B), llama_cmp, 5, (),
         "1.24B Llama: threefold against the plain loop, MFU of each"),
        ("fp8-gemm", 1, START_S, 0, FP8_FLOPS, 10, ("torchao",), "fp8 against bf16 by GEMM shape"),
        ("sync", 1, START_S, 0, 0, 10, (), "host syncs inside a step: 0"),
        ("planner-kernels", 1, START_S, 0, planner_flops(), 10, (), "the planner's kernel model on this GPU"),
        ("run-bf16", 2, tiny + LAUNCH_S, 0, 0, 2, (), "threefold train --nproc 1 over NCCL"),
        ("run-fp16", 2, tiny + LAUNCH_S, 0, 0, 2, (), ""),
        ("run-zero3", 2, tiny + LAUNCH_S, 0, 0, 2, (), ""),
        ("run-offload", 2, tiny + LAUNCH_S, 0, 0, 2, (), ""),
        ("save", 2, tiny + LAUNCH_S, 0, 0, 4, (), "an async save at step 3 of 6"),
        ("resume", 2, tiny + LAUNCH_S, 0, 0, 4, (), "resumed from it"),
        ("bitwise", 2, 2, 0, 0, 0, (), "the two checkpoints byte for byte"),
        ("runs-figures", 2, 5, 0, 0, 0, (), ""),
        ("fp8-bf16", 2, START_S + LAUNCH_S, THREEFOLD_COMPILE_S, fp8_run, 0, ("torchao",),
         "a 4-block Llama-7B, bf16 (the fp8 run's baseline)"),
        ("fp8-train", 2, START_S + LAUNCH_S, 2 * THREEFOLD_COMPILE_S, fp8_run, 0, ("torchao",),
         "the same in fp8 (more graphs: casts and scaled matmuls)"),
        ("fp8-figures", 2, 5, 0, 0, 0, ("torchao",), ""),
        ("gpt2-train", 2, START_S + LAUNCH_S, THREEFOLD_COMPILE_S, 30 * step_flops(GPT2, 16 * 1024, 1024), 0, (),
         "GPT-2 124M through threefold train --compile (its own loop)"),
        ("gpt2-train-figures", 2, 5, 0, 0, 0, (), ""),
        ("gpu-tests", 2, START_S, 0, 0, 45, ("pytest",), "tests/gpu under pytest"),
    ]


def estimate(row: tuple) -> int:
    _, _, start, compile_s, flops, extra, _, _ = row
    return round(start + compile_s + flops / (PEAK * MFU) + extra)


# bytes per parameter each side keeps from step to step (docs/gpu.md, "The benchmark"): threefold bf16 weights and
# gradient buckets (2 + 2), fp32 masters and their gradient buffer (4 + 4), Adam's two fp32 moments (8); the
# plain loop and Hugging Face fp32 weights and gradients (4 + 4) and the moments (8)
BYTES_PER_PARAM = {"threefold": 20, "plain": 16, "hf": 16}
HEADROOM = 0.9  # of the free memory: the allocator's fragmentation, the CUDA context, compile workspaces


def activation_bytes(layers: int, hidden: int, ffn: int, vocab: int, tokens: int) -> int:
    """One side's step, bf16, flash attention, no recomputation: per token and block 16 h + 6 ffn bytes (the
    saved inputs of the norms, qkv, attention output, the MLP's up, gate and down), and 12 bytes per logit
    (the bf16 logits, their fp32 upcast in the loss, the fp32 and bf16 gradient)."""
    return tokens * (layers * (16 * hidden + 6 * ffn) + 12 * vocab)


def memory_plan(params: int, layers: int, hidden: int, ffn: int, vocab: int, batch: int, seq: int,
                free_bytes: float | None, sides=("threefold", "plain", "hf")) -> dict:
    """The sides and the batch that fit `free_bytes`: every side's state stays resident (the rounds
    alternate), one side's activations at a time. Drops the Hugging Face side first, then halves the batch;
    None (a CPU): everything kept."""
    kept, notes = list(sides), []

    def total(b: int) -> int:
        return sum(BYTES_PER_PARAM[s] * params for s in kept) + activation_bytes(layers, hidden, ffn, vocab, b * seq)

    def fits(b: int) -> bool:
        return free_bytes is None or total(b) <= HEADROOM * free_bytes

    gib = 2 ** 30
    if "hf" in kept and not fits(batch):
        need = total(batch) / gib
        kept.remove("hf")
        notes.append(f"hf: dropped, the three sides need {need:.1f} GiB, {HEADROOM:.0%} of the free "
                     f"{free_bytes / gib:.1f} GiB is {HEADROOM * free_bytes / gib:.1f}")
    first = batch
    while batch > 1 and not fits(batch):
        batch //= 2
    if batch != first:
        notes.append(f"batch {first} -> {batch} to fit {free_bytes / gib:.1f} GiB free")
    return {"sides": kept, "batch": batch, "params": params, "bytes_per_param": {s: BYTES_PER_PARAM[s] for s in kept},
            "state_gib": sum(BYTES_PER_PARAM[s] * params for s in kept) / gib,
            "activations_gib": activation_bytes(layers, hidden, ffn, vocab, batch * seq) / gib,
            "total_gib": total(batch) / gib, "free_gib": None if free_bytes is None else free_bytes / gib,
            "fits": fits(batch), "notes": notes}


HOW = {"torchao": "pip install --target vendor torchao==0.18.0 --no-deps",
       "pytest": "pip install --target vendor pytest"}


def missing(packages, found=None) -> list[str]:
    """The packages of `packages` this interpreter cannot import (found by their specs, none imported)."""
    def present(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return [p for p in packages if not (found or present)(p)]


def send_along(rows: list[tuple], found=None) -> str:
    """One line: what must be sent along with the tree for every stage to run, and how."""
    needs: dict[str, list[str]] = {}
    for name, *_, packages, _ in rows:
        for p in missing(packages, found):
            needs.setdefault(p, []).append(name)
    if not needs:
        return "send along: nothing, every stage's packages are here"
    parts = [f"{p} for {', '.join(stages)}: {HOW[p]}" for p, stages in needs.items()]
    return f"send along: {'; '.join(parts)}; and run with carry=[vendor] (gpu.sh puts vendor/ on PYTHONPATH)"


def calls(rows: list[tuple]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for row in rows:
        out.setdefault(row[1], []).append(row[0])
    return out


def main(argv: list[str]) -> int:
    rows = stage_rows()
    if argv[1:] == ["shell"]:
        for row in rows:
            print(f"{row[0]}\t{row[1]}\t{estimate(row)}\t{','.join(missing(row[6])) or '-'}")
        print(f"SEND\t{send_along(rows)}")
        return 0
    if argv[1:] == ["table"]:
        print("| call | stage | estimate s | start-up + compile + compute | needs | what |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in rows:
            name, call, start, compile_s, flops, extra, packages, what = row
            print(f"| {call} | `{name}` | {estimate(row)} | {start + extra:g} + {compile_s:g} + "
                  f"{flops / (PEAK * MFU):.1f} | {', '.join(packages) or '-'} | {what} |")
        for call, names in calls(rows).items():
            total = sum(estimate(r) for r in rows if r[1] == call)
            print(f"\ncall {call}: {total} s estimated ({len(names)} stages)")
        return 0
    print("usage: python bench/gpu_stages.py shell|table", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
