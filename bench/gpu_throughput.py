"""Single-GPU throughput and MFU of the reference model (GPT-2 124M, bf16 autocast).

FLOPs per token = 6 N + 12 L h s (N parameters, L layers, h hidden, s sequence length):
forward + backward of every weight, plus the attention scores and values. MFU is the
achieved FLOP/s over the device's dense bf16 peak.

    python bench/gpu_throughput.py [--model gpt2-124m] [--batch 16] [--seq-len 1024] [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checks import device_peak as peak_of_name  # noqa: E402  (one table of peaks, NVL parts included)
from threefold.config import load_config
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model, count_parameters
from threefold.train.optim import param_groups

def device_peak(device: torch.device) -> float | None:
    """The dense bf16 peak of a CUDA device (bench/gpu_checks.py PEAKS), None on CPU or for an unknown part."""
    return peak_of_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, [f"model.preset={args.model}", f"train.seq_len={args.seq_len}"])
    model = build_model(cfg.model, seed=0, device=device)
    step_model = torch.compile(model) if args.compile else model
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), 0.1), lr=3e-4, fused=fused)
    sampler = Sampler(load_tokens("synthetic", cfg.model.vocab), args.seq_len, args.batch, seed=0)
    tokens_per_step = args.batch * args.seq_len

    def step(i: int) -> torch.Tensor:
        batch = sampler.step_batch(i)
        inputs, targets = batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(inputs, targets) / tokens_per_step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    float(loss)  # waits for the device
    elapsed = time.perf_counter() - start

    n = count_parameters(cfg.model)
    m = cfg.model
    flops_per_token = 6 * n + 12 * m.layers * m.hidden * args.seq_len
    tokens_per_s = tokens_per_step * args.steps / elapsed
    achieved = flops_per_token * tokens_per_s
    peak = device_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__} model={args.model} params={n:,} batch={args.batch} "
          f"seq={args.seq_len} compile={args.compile}")
    print(f"step_time_s={elapsed / args.steps:.4f} tokens_per_s={tokens_per_s:,.0f} "
          f"achieved_tflops={achieved / 1e12:.1f} loss={float(loss):.4f}")
    if peak:
        print(f"MFU={achieved / peak:.3f} (peak bf16 {peak / 1e12:.0f} TFLOP/s)")
        print(f"peak_memory_gib={torch.cuda.max_memory_allocated(device) / 2**30:.2f}")


if __name__ == "__main__":
    main()
