#!/usr/bin/env bash
# Every GPU question in calls of at most --budget seconds (default 540) on one GPU, from the source tree (no
# install; needs torch, safetensors, numpy; torchao for the fp8 stages and pytest for gpu-tests, each from
# vendor/ when the tree has one; transformers only for llama-compare's optional Hugging Face side):
#
#     bash bench/gpu.sh [--budget SECONDS] [--only STAGE,...] [--smoke]    (docs/gpu.md, "The benchmark")
#
# The two calls of a GPU lease (on a CUDA machine the default is call 1; --smoke runs every stage):
#     bash bench/gpu.sh                  call 1, about 372 s estimated: preflight, gpt2-compare, llama-compare,
#                                        fp8-gemm, sync, planner-kernels (every figure the issue asks for)
#     bash bench/gpu.sh --only call2     call 2, about 540 s: the tiny runs over NCCL, save / resume / bitwise,
#                                        the fp8 training runs, gpt2-train, gpu-tests (where pytest is)
# --only takes comma-separated shell patterns of stage names (e.g. --only 'fp8-*,llama-compare') and the
# names call1, call2, all; the others are recorded as skipped, "not selected". A pattern naming no stage:
# exit 2. The stages, their order (by value), calls, needs and estimated seconds on one H100 with cold
# compile caches are bench/gpu_stages.py's (`python bench/gpu_stages.py table`; each estimate is start-up +
# compilation + FLOPs / (989 TFLOP/s x 30% MFU), its header says how). A stage runs under `timeout` (three
# times its estimate, at least 120 s, at most what is left of the budget); one whose estimate exceeds what is left, or whose
# packages are missing, is skipped and says why; none stops the others.
#
# What comes back: at most 8 files directly under $OUT (default runs/gpu-<UTC time>): results.json (every
# stage's figures), gpu.log (everything printed), status.tsv (stage, exit code or "skip", seconds, note),
# measured-gpu.toml (planner-kernels). Run directories, checkpoints, per-stage JSON and scratch go to a work
# directory outside $OUT ($WORK, default ${TMPDIR:-/tmp}/threefold-gpu-<UTC time>, named in gpu.log); at the
# end anything else in $OUT is moved there and the script ends 1.
# --smoke runs every stage on CPU with tiny shapes (aot_eager compiles; the sync counts say "n/a"), and
# the training stages in the calling process, without `--nproc 1`'s launcher (tests/e2e cover the launcher;
# here it would double each stage's start-up).
set -uo pipefail  # no -e: a failing stage is recorded and the next one runs
set -f  # no pathname expansion: --only's patterns are matched against stage names, never against files
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
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "gpu.sh: unknown option '$1' (--budget SECONDS, --only STAGE,..., --smoke)" >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu.sh: --budget must be whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
VENDOR=""
[ -d "$ROOT/vendor" ] && VENDOR=":$ROOT/vendor"  # torchao / pytest for the GPU machine, which has no package registry
export PYTHONPATH="$ROOT/src$VENDOR${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# the stages in order, each one's call, estimate and missing packages, and the one line of what to send along
PLAN=$("$PY" bench/gpu_stages.py shell) || { echo "gpu.sh: $PY bench/gpu_stages.py shell failed" >&2; exit 2; }
declare -A CALL EST MISSING
STAGES=""
SEND=""
while IFS=$'\t' read -r name call est missing; do
    if [ "$name" = SEND ]; then SEND=$call; continue; fi
    STAGES="$STAGES $name"
    CALL[$name]=$call EST[$name]=$est MISSING[$name]=$missing
done <<< "$PLAN"
STAGES=${STAGES# }
read -r -a STAGE_LIST <<< "$STAGES"
# call1 / call2 / all name groups of stages; the default: call 1 on a GPU, every stage with --smoke
expand() {
    local pattern out="" name
    local IFS=,
    for pattern in $1; do
        case "$pattern" in
            all) out="$out,*" ;;
            call[0-9]) for name in "${STAGE_LIST[@]}"; do [ "${CALL[$name]}" = "${pattern#call}" ] && out="$out,$name"; done ;;
            *) out="$out,$pattern" ;;
        esac
    done
    echo "${out#,}"
}
if [ -z "$ONLY" ]; then
    if [ "$SMOKE" = 1 ]; then ONLY=all; else ONLY=call1; fi
fi
SELECTION=$(expand "$ONLY")
# a pattern of --only that names no stage is a typo: refused before anything runs
IFS=, read -r -a PATTERNS <<< "$SELECTION"
for pattern in "${PATTERNS[@]}"; do
    hit=0
    for name in $STAGES; do
        # shellcheck disable=SC2053  # the pattern is a pattern
        [[ "$name" == $pattern ]] && hit=1
    done
    if [ "$hit" = 0 ]; then
        echo "gpu.sh: --only '$pattern' matches no stage; the stages: $STAGES (or call1, call2, all)" >&2
        exit 2
    fi
done
STAMP=$(date -u +%Y%m%d-%H%M%S)
OUT=${OUT:-runs/gpu-$STAMP}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
if [ -e "$OUT/status.tsv" ]; then echo "gpu.sh: $OUT already holds a run (status.tsv); set OUT to a new directory" >&2; exit 2; fi
WORK=${WORK:-${TMPDIR:-/tmp}/threefold-gpu-$STAMP-$$}
mkdir -p "$WORK/results" || exit 2
WORK=$(cd "$WORK" && pwd)
case "$WORK/" in "$OUT/"*) echo "gpu.sh: WORK ($WORK) must be outside OUT ($OUT): only 8 files of OUT come back" >&2; exit 2 ;; esac
export OUT WORK
exec > >(tee -a "$OUT/gpu.log") 2>&1
LOGGER=$!
START=$SECONDS
RESERVE=5  # kept for the results at the end
NEXT=0     # the index in STAGE_LIST of the stage expected next
printf 'stage\trc\tseconds\tnote\n' > "$OUT/status.tsv"

# selected NAME: whether NAME matches one of the selection's comma-separated patterns
selected() {
    local pattern
    local IFS=,
    for pattern in $SELECTION; do
        # shellcheck disable=SC2053  # the pattern is a pattern
        [[ "$1" == $pattern ]] && return 0
    done
    return 1
}

# skip NAME NOTE: record NAME as skipped
skip() {
    echo "== $1: skipped, $2"
    printf '%s\tskip\t0\t%s\n' "$1" "$2" >> "$OUT/status.tsv"
}

# stage NAME CMD...: run CMD under timeout (three times NAME's estimate, or what is left of the budget when
# that is less), or skip it: not selected, a package missing, or less left than its estimate. The exit code
# (124: timed out) goes to status.tsv. Stages are called in bench/gpu_stages.py's order, which is checked.
stage() {
    local name=$1
    shift
    if [ "$NEXT" -ge "${#STAGE_LIST[@]}" ] || [ "${STAGE_LIST[$NEXT]}" != "$name" ]; then
        echo "== $name: out of order or unknown (bench/gpu_stages.py lists: $STAGES)"
        printf '%s\t2\t0\tnot in bench/gpu_stages.py order\n' "$name" >> "$OUT/status.tsv"
        return
    fi
    NEXT=$((NEXT + 1))
    if ! selected "$name"; then skip "$name" "not selected (--only $ONLY)"; return; fi
    if [ "${MISSING[$name]}" != "-" ]; then skip "$name" "needs ${MISSING[$name]} (gpu.log: send along)"; return; fi
    local need=${EST[$name]}
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    [ "$left" -lt 0 ] && left=0  # the reserve already eaten into: nothing is left, not less than nothing
    if [ "$left" -lt "$need" ]; then skip "$name" "budget: ${left}s left, needs ${need}s"; return; fi
    local limit=$((3 * need))
    [ "$limit" -lt 120 ] && limit=120  # a loaded machine (--smoke beside other work) starts slowly
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at $((SECONDS - START))s, estimate ${need}s, timeout ${limit}s): $*"
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@"
    rc=$?
    local note=""
    [ "$rc" -eq 124 ] && note="timed out after ${limit}s"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" >> "$OUT/status.tsv"
}

R=$WORK/results
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

echo "== gpu.sh: out=$OUT work=$WORK budget=${BUDGET}s smoke=$SMOKE only=$ONLY $(date -u +%FT%TZ)"
echo "== $SEND"
uptime || true
# call 1: what the GPU hour is for, by value
stage preflight "$PY" bench/gpu_checks.py preflight --json "$R/preflight.json" "${FLAG[@]}"
stage gpt2-compare "$PY" bench/gpu_compare.py "${GPT2_CMP[@]}" --profile-steps 3 \
    --json "$R/gpt2_compare.json" --out "$WORK/gpt2-compare"
stage llama-compare "$PY" bench/gpu_compare.py "${LLAMA_CMP[@]}" --json "$R/llama_compare.json" \
    --out "$WORK/llama-compare"
stage fp8-gemm "$PY" bench/fp8_gemm.py --json "$R/fp8_gemm.json" "${FLAG[@]}"
stage sync "$PY" bench/gpu_checks.py sync --json "$R/sync.json" --scratch "$WORK/sync" "${FLAG[@]}"
stage planner-kernels "$PY" bench/planner_kernels.py --json "$R/planner_kernels.json" \
    --toml "$OUT/measured-gpu.toml" "${FLAG[@]}"
# call 2: the rest
for run in "bf16:--precision bf16" "fp16:--precision fp16" "zero3:--zero 3" \
           "offload:--zero 1 --set parallel.offload=optimizer"; do
    # shellcheck disable=SC2086  # the options of each run are words
    stage "run-${run%%:*}" "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" --steps 6 ${run#*:} --out "$WORK/run-${run%%:*}"
done
SAVE=(--steps 6 --save-every 3 --async-save --deterministic)
stage save "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" "${SAVE[@]}" --out "$WORK/save"
stage resume "${TRAIN[@]}" "${TINY[@]}" "${DEV[@]}" "${SAVE[@]}" --out "$WORK/resume" \
    --resume "$WORK/save/checkpoints/step-00000003"
stage bitwise "$PY" bench/gpu_checks.py bitwise --json "$R/save_resume.json" --step 6 "$WORK/save" "$WORK/resume"
stage runs-figures "$PY" bench/gpu_checks.py summary --json "$R/runs.json" --skip 1 \
    bf16="$WORK/run-bf16" fp16="$WORK/run-fp16" zero3="$WORK/run-zero3" offload="$WORK/run-offload"
stage fp8-bf16 "${TRAIN[@]}" "${FP8_MODEL[@]}" "${DEV[@]}" --precision bf16 --out "$WORK/fp8-bf16"
stage fp8-train "${TRAIN[@]}" "${FP8_MODEL[@]}" "${DEV[@]}" "${FP8[@]}" --out "$WORK/fp8-train"
stage fp8-figures "$PY" bench/gpu_checks.py summary --json "$R/fp8_train.json" --skip 2 \
    bf16="$WORK/fp8-bf16" fp8="$WORK/fp8-train"
stage gpt2-train "${TRAIN[@]}" "${GPT2[@]}" "${DEV[@]}" --compile --out "$WORK/gpt2-train"
stage gpt2-train-figures "$PY" bench/gpu_checks.py summary --json "$R/gpt2_train.json" --flat --skip 5 \
    gpt2="$WORK/gpt2-train"
stage gpu-tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu
while [ "$NEXT" -lt "${#STAGE_LIST[@]}" ]; do  # a stage of bench/gpu_stages.py with no call above
    echo "== ${STAGE_LIST[$NEXT]}: listed in bench/gpu_stages.py, never called by gpu.sh"
    printf '%s\t2\t0\tno call in gpu.sh\n' "${STAGE_LIST[$NEXT]}" >> "$OUT/status.tsv"
    NEXT=$((NEXT + 1))
done

"$PY" bench/gpu_checks.py merge "$OUT" --work "$WORK" --budget "$BUDGET" --elapsed "$((SECONDS - START))" \
    --send "$SEND" $([ "$SMOKE" = 1 ] && echo --smoke)
MERGED=$?
echo "== gpu.sh: done in $((SECONDS - START))s; work directory (not brought back): $WORK; stages:"
column -t -s $'\t' "$OUT/status.tsv" 2>/dev/null || cat "$OUT/status.tsv"
FAILED=$(awk -F'\t' 'NR > 1 && $2 != "0" && $2 != "skip"' "$OUT/status.tsv" | wc -l)
exec >&- 2>&-
wait "$LOGGER" 2>/dev/null
[ "$FAILED" -eq 0 ] && [ "$MERGED" -eq 0 ]
