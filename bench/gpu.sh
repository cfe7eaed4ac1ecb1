#!/usr/bin/env bash
# One GPU run that answers every GPU question, in at most --budget seconds (default 540), from the
# source tree (no install; needs torch, safetensors, numpy, and torchao for the fp8 stages: from vendor/
# when the tree has one, `pip install --target vendor torchao==0.18.0 --no-deps`, docs/fp8.md;
# pytest only for the gpu-tests stage, where present; no transformers or tokenizers needed):
#
#     bash bench/gpu.sh [--budget SECONDS] [--only STAGE,...] [--smoke]    (docs/gpu.md, "The benchmark")
#
# --only runs the named stages alone (shell patterns, e.g. --only 'fp8-*,llama-compare'), so one lease can
# be split into calls; the others are recorded as skipped, "not selected"; a pattern naming no stage: exit 2.
#
# Stages, in this order, each under `timeout` (at most its own limit and what is left of the budget;
# a stage that needs more than is left is skipped and says so), none stopping the others:
#   preflight      nvidia-smi, torch / CUDA / NCCL versions, triton, cc, Python.h, one tiny compile
#   sync           host syncs inside a step (torch.cuda.set_sync_debug_mode) for dp, ZeRO-3, bf16, fp16: 0
#   gpu-tests      the suite's CUDA tests (tests/gpu) under pytest, where the machine has pytest
#   run-*          tiny `threefold train --nproc 1` runs (NCCL): bf16, fp16, ZeRO-3, optimizer offload
#   save, resume, bitwise   an async save at step 3 of 6, a run resumed from it, checkpoints compared bitwise
#   gpt2-train     GPT-2 124M through `threefold train --compile` (its own loop), tokens/s and MFU
#   gpt2-compare   bench/gpu_compare.py: threefold against a compiled plain PyTorch loop, alternating
#                  rounds, with a 3-step torch.profiler summary per side
#   fp8-gemm       bench/fp8_gemm.py: one linear's fp8 / bf16 forward + backward time by GEMM shape, beside
#                  the auto rule's model of it (planner/compute.py), the measured table of docs/fp8.md
#   planner-kernels  bench/planner_kernels.py: the planner's GEMM and attention model against this GPU, for the
#                  layers of its validation set's models (the calibration set docs/planner.md asks for); the
#                  preset with the measured shares as a GPU kind: measured-gpu.toml (threefold plan --gpu FILE)
#   fp8-bf16, fp8-train, fp8-figures   a 4-block Llama-7B-shaped model in bf16 and --precision fp8 (auto):
#                  tokens/s of each (results fp8_train)
#   llama-compare  the ~1.2B Llama (Llama 3.2 1B's shape, threefold's reference decoder), last, when time is left
# Files in $OUT (default runs/gpu-<UTC time>): gpu.log (everything printed), status.tsv (stage, exit
# code or "skip", seconds, note), results.json (every figure), results/<stage>.json, the runs' directories,
# measured-gpu.toml (planner-kernels).
# --smoke runs every stage on CPU with tiny shapes (aot_eager compiles; the sync counts say "n/a"), and
# the training stages in the calling process, without `--nproc 1`'s launcher (tests/e2e cover the launcher;
# here it would double each stage's start-up).
set -uo pipefail  # no -e: a failing stage is recorded and the next one runs
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
BUDGET=540
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --budget) BUDGET=${2:?--budget needs SECONDS}; shift ;;
        --budget=*) BUDGET=${1#*=} ;;
        --only) ONLY=${2:?--only needs STAGE,...}; shift ;;
        --only=*) ONLY=${1#*=} ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "gpu.sh: unknown option '$1' (--budget SECONDS, --only STAGE,..., --smoke)" >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu.sh: --budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
# every stage, in order (`stage` refuses a name missing here, so the list cannot drift from the calls below)
STAGES="preflight sync gpu-tests run-bf16 run-fp16 run-zero3 run-offload save resume bitwise runs-figures \
gpt2-train gpt2-train-figures gpt2-compare fp8-gemm planner-kernels fp8-bf16 fp8-train fp8-figures llama-compare"
# a pattern of --only that names no stage is a typo: refused before anything runs
IFS=, read -r -a PATTERNS <<< "$ONLY"
for pattern in "${PATTERNS[@]}"; do
    hit=0
    for name in $STAGES; do
        # shellcheck disable=SC2053  # the pattern is a pattern
        [[ "$name" == $pattern ]] && hit=1
    done
    if [ "$hit" = 0 ]; then
        echo "gpu.sh: --only '$pattern' matches no stage; the stages: $STAGES" >&2
        exit 2
    fi
done
OUT=${OUT:-runs/gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/results" || exit 2
OUT=$(cd "$OUT" && pwd)
if [ -e "$OUT/status.tsv" ]; then echo "gpu.sh: $OUT already holds a run (status.tsv); set OUT to a new directory" >&2; exit 2; fi
VENDOR=""
[ -d "$ROOT/vendor" ] && VENDOR=":$ROOT/vendor"  # torchao for the GPU machine, which has no package registry
export OUT PYTHONPATH="$ROOT/src$VENDOR${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
exec > >(tee -a "$OUT/gpu.log") 2>&1
LOGGER=$!
START=$SECONDS
RESERVE=5  # kept for the results at the end
printf 'stage\trc\tseconds\tnote\n' > "$OUT/status.tsv"

# selected NAME: whether NAME matches one of --only's comma-separated patterns
selected() {
    local pattern
    local IFS=,
    for pattern in $ONLY; do
        # shellcheck disable=SC2053  # the pattern is a pattern
        [[ "$1" == $pattern ]] && return 0
    done
    return 1
}

# stage NAME LIMIT_S NEED_S CMD...: run CMD under timeout (LIMIT_S, or less when less is left), or skip it
# when less than NEED_S is left; the exit code (124: timed out) goes to status.tsv
stage() {
    local name=$1 limit=$2 need=$3
    shift 3
    if [[ " $STAGES " != *" $name "* ]]; then
        echo "== $name: not in STAGES (bench/gpu.sh): add it there"
        printf '%s\t2\t0\tnot in STAGES\n' "$name" >> "$OUT/status.tsv"
        return
    fi
    if [ -n "$ONLY" ] && ! selected "$name"; then
        echo "== $name: skipped, not selected (--only $ONLY)"
        printf '%s\tskip\t0\tnot selected (--only)\n' "$name" >> "$OUT/status.tsv"
        return
    fi
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    [ "$left" -lt 0 ] && left=0  # the reserve already eaten into: nothing is left, not less than nothing
    if [ "$left" -lt "$need" ]; then
        echo "== $name: skipped, ${left}s of the budget left, it needs ${need}s"
        printf '%s\tskip\t0\tbudget: %ss left, needs %ss\n' "$name" "$left" "$need" >> "$OUT/status.tsv"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at $((SECONDS - START))s, timeout ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    local note=""
    [ "$rc" -eq 124 ] && note="timed out after ${limit}s"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" >> "$OUT/status.tsv"
}

R=$OUT/results
TRAIN=("$PY" -m threefold train --nproc 1 --no-progress --set run.plot=false --set run.collective_timeout_s=60)
if [ "$SMOKE" = 1 ]; then
    TRAIN=("$PY" -m threefold train --no-progress --set run.plot=false --set run.collective_timeout_s=60)
    FLAG=(--smoke)
    DEV=(--set run.device=cpu)
    TINY=(--model tiny --global-batch 4 --seq-len 32)
    GPT2=(--model tiny --steps 5 --global-batch 4 --seq-len 32 --set debug.compile_backend=aot_eager)
    GPT2_CMP=(--smoke --model tiny)
    LLAMA_CMP=(--smoke --model tiny-llama)
    FP8_MODEL=(--model tiny-llama --steps 4 --global-batch 4 --seq-len 32)
    FP8=(--precision fp8 --set precision.fp8_linears=all --set precision.fp8_skip_first_last=false)
else
    FLAG=()
    DEV=(--set run.device=cuda)
    TINY=(--model tiny --global-batch 8 --seq-len 64)
    GPT2=(--model gpt2-124m --steps 30 --global-batch 16 --seq-len 1024 --precision bf16)
    GPT2_CMP=(--model gpt2-124m --batch 16 --seq-len 1024 --rounds 4 --steps 10)
    LLAMA_CMP=(--model llama-1b --batch 4 --seq-len 2048 --rounds 3 --steps 5)
    FP8_MODEL=(--model llama-7b --set model.layers=4 --steps 12 --global-batch 2 --seq-len 2048 --compile)
    FP8=(--precision fp8)
fi

echo "== gpu.sh: out=$OUT budget=${BUDGET}s smoke=$SMOKE $(date -u +%FT%TZ)"
uptime || true
stage preflight 60 20 "$PY" bench/gpu_checks.py preflight --json "$R/preflight.json" "${FLAG[@]}"
stage sync 150 30 "$PY" bench/gpu_checks.py sync --json "$R/sync.json" --scratch "$OUT/sync" "${FLAG[@]}"
# the CUDA tests need pytest, which the GPU machine may lack: without it the stage says so and passes
# (on --smoke they run and skip, no CUDA device)
if "$PY" -c "import pytest" 2>/dev/null; then
    stage gpu-tests 150 40 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
else
    stage gpu-tests 5 0 "$PY" -c "print('gpu-tests: not run, this python has no pytest')"
fi
for run in "bf16:--precision bf16" "fp16:--precision fp16" "zero3:--zero 3" \
           "offload:--zero 1 --set parallel.offload=optimizer"; do
    # shellcheck disable=SC2086  # the options of each run are words
    stage "run-${run%%:*}" 90 15 "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" --steps 6 ${run#*:} --out "$OUT/run-${run%%:*}"
done
SAVE=(--steps 6 --save-every 3 --async-save --deterministic)
stage save 90 15 "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" "${SAVE[@]}" --out "$OUT/save"
stage resume 90 15 "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" "${SAVE[@]}" --out "$OUT/resume" \
    --resume "$OUT/save/checkpoints/step-00000003"
stage bitwise 30 5 "$PY" bench/gpu_checks.py bitwise --json "$R/save_resume.json" --step 6 "$OUT/save" "$OUT/resume"
stage runs-figures 30 5 "$PY" bench/gpu_checks.py summary --json "$R/runs.json" --skip 1 \
    bf16="$OUT/run-bf16" fp16="$OUT/run-fp16" zero3="$OUT/run-zero3" offload="$OUT/run-offload"
stage gpt2-train 240 60 "${TRAIN[@]}" "${GPT2[@]}" "${DEV[@]}" --compile --out "$OUT/gpt2-train"
stage gpt2-train-figures 30 5 "$PY" bench/gpu_checks.py summary --json "$R/gpt2_train.json" --flat --skip 5 \
    gpt2="$OUT/gpt2-train"
stage gpt2-compare 300 90 "$PY" bench/gpu_compare.py "${GPT2_CMP[@]}" --profile-steps 3 \
    --json "$R/gpt2_compare.json" --out "$OUT/gpt2-compare"
stage fp8-gemm 90 30 "$PY" bench/fp8_gemm.py --json "$R/fp8_gemm.json" "${FLAG[@]}"
stage planner-kernels 90 30 "$PY" bench/planner_kernels.py --json "$R/planner_kernels.json" \
    --toml "$OUT/measured-gpu.toml" "${FLAG[@]}"
stage fp8-bf16 120 40 "${TRAIN[@]}" "${FP8_MODEL[@]}" "${DEV[@]}" --precision bf16 --out "$OUT/fp8-bf16"
stage fp8-train 120 40 "${TRAIN[@]}" "${FP8_MODEL[@]}" "${DEV[@]}" "${FP8[@]}" --out "$OUT/fp8-train"
stage fp8-figures 30 5 "$PY" bench/gpu_checks.py summary --json "$R/fp8_train.json" --skip 2 \
    bf16="$OUT/fp8-bf16" fp8="$OUT/fp8-train"
# the Llama last, only when enough is left (the Hugging Face side needs transformers; absent, it is skipped)
stage llama-compare 300 150 "$PY" bench/gpu_compare.py "${LLAMA_CMP[@]}" --json "$R/llama_compare.json" \
    --out "$OUT/llama-compare"

"$PY" bench/gpu_checks.py merge "$OUT" --budget "$BUDGET" --elapsed "$((SECONDS - START))" \
    $([ "$SMOKE" = 1 ] && echo --smoke)
echo "== gpu.sh: done in $((SECONDS - START))s; stages:"
column -t -s $'\t' "$OUT/status.tsv" 2>/dev/null || cat "$OUT/status.tsv"
FAILED=$(awk -F'\t' 'NR > 1 && $2 != "0" && $2 != "skip"' "$OUT/status.tsv" | wc -l)
exec >&- 2>&-
wait "$LOGGER" 2>/dev/null
[ "$FAILED" -eq 0 ]
