#!/usr/bin/env bash
# On a CUDA machine, from the source tree (no install; needs only torch, safetensors, numpy, tqdm,
# matplotlib):  bash bench/gpu.sh        (docs/gpu.md)
# 1. the NCCL path: threefold's own launcher and trainer on one GPU (nccl backend);
# 2. side by side, alternating rounds, wall time with host work: threefold's trainer (bf16) against a
#    compiled plain PyTorch loop, GPT-2 124M and a ~1.2B Llama built from a config; tokens/s and MFU
#    against the device's dense bf16 peak (H200 SXM 989 / NVL 835 TFLOP/s, from the device name).
#    The Hugging Face Llama side runs only where transformers is installed (it says when it is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/threefold-gpu}
export OUT
mkdir -p "$OUT"

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
uptime || true
echo "== NCCL path: threefold train --nproc 1 on cuda"
$PY -m threefold train --nproc 1 --model tiny --steps 10 --global-batch 8 --seq-len 64 --set run.device=cuda \
    --no-progress --out "$OUT/nccl-run"
tail -n 1 "$OUT/nccl-run/metrics.jsonl"
if $PY -c "import pytest" 2>/dev/null; then
    echo "== tests/gpu (NCCL training, no host sync inside a step)"
    $PY -m pytest -q -p no:cacheprovider tests/gpu
else
    echo "== tests/gpu skipped: pytest is not installed"
fi
echo "== GPT-2 124M, bf16: threefold vs compiled plain loop"
$PY bench/gpu_compare.py --model gpt2-124m --batch 16 --seq-len 1024 --rounds 5 --steps 10 --out "$OUT/gpt2"
echo "== Llama ~1.2B (Llama 3.2 1B shape), bf16: threefold vs compiled plain loop (vs HF if installed)"
$PY bench/gpu_compare.py --model llama-1b --batch 4 --seq-len 2048 --rounds 5 --steps 5 --out "$OUT/llama"
