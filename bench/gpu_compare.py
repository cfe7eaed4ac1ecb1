"""One GPU: threefold's trainer against a compiled plain PyTorch loop, side by side, in bf16.

    python bench/gpu_compare.py --model gpt2-124m [--batch 16] [--seq-len 1024] [--rounds 5] [--steps 10]
    python bench/gpu_compare.py --model llama-1b  [--batch 8]  [--seq-len 2048]
    python bench/gpu_compare.py --smoke           (CPU, tiny model, fp32, no compile: checks the script only)

Sides, each with its usual settings, in one process, alternating rounds of `--steps` steps:

* **threefold** - `Trainer.train_one_step` (bf16 parameters, fp32 masters, the whole step:
  sampler, forward/backward, gradient norm and clipping, AdamW, metrics record), its forward
  and loss compiled (`train.compile=true`) on CUDA;
* **plain** - the same model (threefold's decoder, built from the same config) in a plain loop:
  fp32 parameters under `torch.autocast(bfloat16)`, `torch.compile(model)`, clipping, fused AdamW;
* **hf** (llama only, when `transformers` is importable) - Hugging Face `LlamaForCausalLM`
  built from a `LlamaConfig` with the same shape, compiled, the same loop. The GPU machine the
  project uses has no transformers: this side is then skipped and says so.

Time is wall time of each round, host work included, with a device synchronisation at its end
(every wait counted). tokens/s = batch x seq x steps / time. MFU = FLOP/s / peak, FLOPs per token
6 N + 12 L h s (N all parameters, L layers, h hidden, s sequence: weights forward + backward, plus
attention scores and values). Peak = the device's dense bf16 peak: H200 SXM 989 TFLOP/s, H200 NVL
835 (detected from the device name), H100 SXM 989, A100 312, or `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from threefold.config import load_config  # noqa: E402
from threefold.data import Sampler, load_tokens  # noqa: E402
from threefold.models.decoder import build_model, count_parameters  # noqa: E402
from threefold.train.optim import param_groups  # noqa: E402

# A Llama of about 1.2 B parameters (the shape of Llama 3.2 1B: tied embeddings), from the llama preset
LLAMA_1B = ["model.preset=llama-7b", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=8192", "model.vocab=128256", "model.rope_theta=500000.0", "model.tie_embeddings=true"]
MODELS = {"gpt2-124m": ["model.preset=gpt2-124m"], "llama-1b": LLAMA_1B, "tiny": ["model.preset=tiny"]}
PEAKS = [("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12)]


def device_peak(name: str) -> float | None:
    return next((peak for key, peak in PEAKS if key in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_side(cfg, device, batch: int, seq: int, compile_: bool, dtype):
    model = build_model(cfg.model, seed=0, device=device)
    step_model = torch.compile(model) if compile_ else model
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), 0.1), lr=3e-4, fused=device.type == "cuda")
    sampler = Sampler(load_tokens("synthetic", cfg.model.vocab), seq, batch, seed=0)
    tokens = batch * seq

    def step(i: int):
        b = sampler.step_batch(i)
        inputs, targets = b.inputs.to(device, non_blocking=True), b.targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(inputs, targets) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def hf_side(cfg, device, batch: int, seq: int, compile_: bool, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf_cfg = LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
                         num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                         max_position_embeddings=seq, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings)
    model = LlamaForCausalLM(hf_cfg).to(device)
    step_model = torch.compile(model) if compile_ else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    sampler = Sampler(load_tokens("synthetic", m.vocab), seq, batch, seed=0)

    def step(i: int):
        b = sampler.step_batch(i)
        inputs = b.inputs.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def threefold_side(overrides: list[str], out: str):
    from threefold.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*overrides, f"run.out={out}", "run.progress=false", "run.plot=false",
                                         "train.steps=1000000", "checkpoint.save_every=0"]))
    trainer.observer.start()
    return lambda i: trainer.train_one_step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per side before timing (compilation)")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/threefold-gpu") + "/compare")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, fp32, no compile: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.batch, args.seq_len, args.rounds, args.steps, args.warmup = "tiny", 2, 32, 2, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_ = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    overrides = [*MODELS[args.model], f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
                 "train.microbatches=1", "data.source=synthetic",
                 f"precision.compute={'bf16' if dtype == torch.bfloat16 else 'fp32'}",
                 f"run.device={device.type}"]
    cfg = load_config(None, overrides)
    # threefold compiles its forward and loss (--compile) where the plain side compiles its model
    sides = {"threefold": threefold_side(overrides + (["train.compile=true"] if compile_ else []), args.out),
             "plain": plain_side(cfg, device, args.batch, args.seq_len, compile_, dtype)}
    if args.model == "llama-1b":
        try:
            sides["hf"] = hf_side(cfg, device, args.batch, args.seq_len, compile_, dtype)
        except ImportError:
            print("hf: skipped - transformers is not installed here (the plain side runs threefold's llama "
                  "decoder with the same shape instead)")
    for name, step in sides.items():
        for i in range(args.warmup):
            step(i)
        sync(device)
    times = {name: [] for name in sides}
    for r in range(args.rounds):  # alternating rounds, each ended by a synchronisation
        for name, step in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            sync(device)
            start = time.perf_counter()
            for i in range(args.steps):
                step(args.warmup + r * args.steps + i)
            sync(device)
            times[name].append(time.perf_counter() - start)
    m = cfg.model
    n = count_parameters(m)
    flops_per_token = 6 * n + 12 * m.layers * m.hidden * args.seq_len
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak(dev_name)
    print(f"device={dev_name} torch={torch.__version__} model={args.model} params={n:,} batch={args.batch} "
          f"seq={args.seq_len} dtype={str(dtype).replace('torch.', '')} compile(plain)={compile_} "
          f"rounds={args.rounds}x{args.steps} peak={peak / 1e12 if peak else float('nan'):.0f}TF")
    rate = {}
    for name, ts in times.items():
        per_round = statistics.median(ts)
        rate[name] = args.batch * args.seq_len * args.steps / per_round
        mfu = f" MFU={flops_per_token * rate[name] / peak:.3f}" if peak else ""
        print(f"{name:>10}: tokens_per_s={rate[name]:,.0f} step_s={per_round / args.steps:.4f}{mfu} "
              f"(rounds: {', '.join(f'{t:.3f}' for t in ts)} s)")
    for name in rate:
        if name != "threefold":
            print(f"threefold / {name} = {rate['threefold'] / rate[name]:.3f}")
    if device.type == "cuda":
        print(f"peak_memory_gib={torch.cuda.max_memory_allocated(device) / 2**30:.2f}")


if __name__ == "__main__":
    main()
