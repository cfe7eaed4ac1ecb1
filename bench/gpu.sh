#!/usr/bin/env bash
# On a CUDA machine, from the source tree (no install needed):  bash bench/gpu.sh
# 1. the NCCL path: threefold's own launcher and trainer on one GPU (nccl backend);
# 2. single-GPU throughput and MFU of GPT-2 124M in bf16, eager and compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/threefold-gpu}
mkdir -p "$OUT"

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
echo "== NCCL path: threefold train --nproc 1 on cuda"
$PY -m threefold train --nproc 1 --model tiny --steps 10 --global-batch 8 --seq-len 64 --set run.device=cuda \
    --no-progress --out "$OUT/nccl-run"
tail -n 1 "$OUT/nccl-run/metrics.jsonl"
echo "== throughput, eager"
$PY bench/gpu_throughput.py --model gpt2-124m --batch 16 --seq-len 1024 --steps 30
echo "== throughput, torch.compile"
$PY bench/gpu_throughput.py --model gpt2-124m --batch 16 --seq-len 1024 --steps 30 --compile
echo "== throughput through threefold's trainer (bf16 compute, fp32 master weights)"
$PY -m threefold train --model gpt2-124m --precision bf16 --seq-len 1024 --global-batch 16 --steps 30 \
    --data synthetic --set run.device=cuda --set run.plot=false --no-progress --out "$OUT/trainer-bf16"
$PY bench/mfu_from_metrics.py "$OUT/trainer-bf16" --skip 5
