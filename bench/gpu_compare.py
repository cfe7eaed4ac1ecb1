"""One GPU: threefold's trainer against a compiled plain PyTorch loop, side by side, in bf16.

    python bench/gpu_compare.py --model gpt2-124m [--batch 16] [--seq-len 1024] [--rounds 5] [--steps 10]
    python bench/gpu_compare.py --model llama-1b  [--batch 8]  [--seq-len 2048]
    python bench/gpu_compare.py --smoke [--model tiny-llama]   (CPU, tiny, fp32, aot_eager: checks the script)
    options: --json PATH (every figure), --profile-steps 3 (a torch.profiler summary per side),
             --backend (torch.compile backend of both sides), --no-hf

Sides, each with its usual settings, in one process, alternating rounds of `--steps` steps:

* **threefold** - `Trainer.launch_step` / `finish_step` (bf16 parameters, fp32 masters, the whole
  step: sampler, forward/backward, gradient norm and clipping, AdamW, metrics record), compiled
  per block (`train.compile=true`);
* **plain** - the same model (threefold's decoder, built from the same config) in a plain loop:
  fp32 parameters under `torch.autocast(bfloat16)`, `torch.compile(model)`, SDPA, clipping, fused
  AdamW;
* **hf** (llama models only, when `transformers` is importable) - Hugging Face `LlamaForCausalLM`
  built from a `LlamaConfig` with the same shape, compiled, the same loop. The GPU machine the
  project uses has no transformers: this side is then skipped and says so.

Every side reads its figures the same way, as threefold's own loop does: step i's figures (loss,
and the gradient norm where the side has one) are read, in one transfer, after step i+1 was
launched, and the last step's at the end of the round. Time is wall time of each round, host
work included, with a device synchronisation at its end (every wait counted). Rounds alternate
the order of the sides; the device's memory peak is reset before each side's round, so each
side's peak is its own (`peak_memory_gib`; `step_memory_gib` is the peak above what was
allocated when the round began: the step's own working set, without the other sides' weights).
tokens/s = batch x seq x steps / time. MFU = FLOP/s / peak, FLOPs per token
6 N + 12 L h s (N all parameters, L layers, h hidden, s sequence: weights forward + backward, plus
attention scores and values). Peak = the device's dense bf16 peak: H200 SXM 989 TFLOP/s, H200 NVL
835 (detected from the device name), H100 SXM 989, A100 312, or `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_checks import device_peak, flops_per_token  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import Sampler, load_tokens  # noqa: E402
from threefold.models.decoder import build_model, count_parameters  # noqa: E402
from threefold.train.optim import param_groups  # noqa: E402

# A Llama of about 1.2 B parameters (the shape of Llama 3.2 1B: tied embeddings), from the llama preset
LLAMA_1B = ["model.preset=llama-7b", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=8192", "model.vocab=128256", "model.rope_theta=500000.0", "model.tie_embeddings=true"]
MODELS = {"gpt2-124m": ["model.preset=gpt2-124m"], "llama-1b": LLAMA_1B, "tiny": ["model.preset=tiny"],
          "tiny-llama": ["model.preset=tiny-llama"]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """The same decoder in a plain loop: fp32 weights under autocast, torch.compile, clipping, fused AdamW."""

    def __init__(self, cfg, device, batch: int, seq: int, backend: str | None, dtype, hf: bool = False):
        m = cfg.model
        if hf:
            from transformers import LlamaConfig, LlamaForCausalLM

            hf_cfg = LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
                                 num_hidden_layers=m.layers, num_attention_heads=m.heads,
                                 num_key_value_heads=m.kv_heads, max_position_embeddings=seq,
                                 rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
                                 attn_implementation="sdpa")
            self.model = LlamaForCausalLM(hf_cfg).to(device)
            params = self.model.parameters()
        else:
            self.model = build_model(m, seed=0, device=device)
            params = param_groups(self.model.named_parameters(), 0.1)
        self.hf = hf
        self.step_model = torch.compile(self.model, backend=backend) if backend else self.model
        self.optimizer = torch.optim.AdamW(params, lr=3e-4, fused=device.type == "cuda")
        self.sampler = Sampler(load_tokens("synthetic", m.vocab), seq, batch, seed=0)
        self.device, self.dtype, self.tokens = device, dtype, batch * seq

    def launch(self, i: int) -> torch.Tensor:
        b = self.sampler.step_batch(i)
        inputs = b.inputs.to(self.device, non_blocking=True)
        targets = b.targets.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            if self.hf:
                loss = self.step_model(input_ids=inputs, labels=inputs).loss
            else:
                loss = self.step_model(inputs, targets) / self.tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([loss.detach().float(), norm.float()])  # the step's figures, on the device

    def read(self, figures: torch.Tensor) -> list[float]:
        return figures.tolist()


class Threefold:
    """`Trainer.launch_step` / `finish_step`: the whole step, read as the trainer's own loop reads it."""

    def __init__(self, overrides: list[str], out: str):
        from threefold.train.trainer import Trainer

        self.trainer = Trainer(load_config(None, [*overrides, f"run.out={out}", "run.progress=false",
                                                  "run.plot=false", "train.steps=1000000",
                                                  "checkpoint.save_every=0"]))
        self.trainer.observer.start()

    def launch(self, i: int):
        return self.trainer.launch_step()

    def read(self, launched) -> list[float]:
        record = self.trainer.finish_step(launched)
        return [record["loss"], record["grad_norm"]]


def run_steps(side, first: int, steps: int) -> list[float]:
    """`steps` steps; each step's figures read after the next one is launched, the last one's at the end."""
    pending, last = None, []
    for i in range(first, first + steps):
        launched = side.launch(i)
        if pending is not None:
            last = side.read(pending)
        pending = launched
    if pending is not None:
        last = side.read(pending)
    return last


def profile_summary(side, first: int, steps: int, device: torch.device, top: int = 10) -> dict:
    """torch.profiler over `steps` steps: the top kernels by device time, kernels per step and the share
    of the wall time some kernel was running (the union of kernel intervals). On CPU: the top operators
    by self time (no device, so no kernels and no busy fraction)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run_steps(side, first, steps)
        sync(device)
        wall = time.perf_counter() - start
    if device.type != "cuda":
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        return {"steps": steps, "wall_s": wall, "kernels_per_step": "n/a", "device_busy_fraction": "n/a",
                "top": [{"name": e.key, "count": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in ops]}
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        count, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, us + e.time_range.elapsed_us())
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if b > end:
            busy += b - max(a, end)
            end = b
    ranked = sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {"steps": steps, "wall_s": wall, "kernels_per_step": len(kernels) / steps,
            "device_busy_fraction": busy / 1e6 / wall, "device_ms_per_step": sum(us for _, us in by_name.values())
            / 1e3 / steps, "top": [{"name": n[:120], "count": c, "ms": us / 1e3} for n, (c, us) in ranked]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per side before timing (compilation)")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--backend", default=None, help="torch.compile backend of both sides (default: inductor "
                        "on CUDA, aot_eager with --smoke)")
    parser.add_argument("--profile-steps", type=int, default=0, help="steps of a torch.profiler summary per side")
    parser.add_argument("--no-hf", action="store_true", help="leave out the Hugging Face side")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/threefold-gpu") + "/compare")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, fp32, aot_eager: checks the script")
    args = parser.parse_args()
    if args.smoke:
        if args.model not in ("tiny", "tiny-llama"):
            args.model = "tiny"
        args.batch, args.seq_len, args.rounds, args.steps, args.warmup = 2, 32, 2, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    overrides = [*MODELS[args.model], f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
                 "train.microbatches=1", "data.source=synthetic",
                 f"precision.compute={'bf16' if dtype == torch.bfloat16 else 'fp32'}",
                 f"run.device={device.type}", "train.compile=true", f"debug.compile_backend={backend}"]
    cfg = load_config(None, overrides)
    sides = {"threefold": Threefold(overrides, args.out), "plain": Plain(cfg, device, args.batch, args.seq_len,
                                                                          backend, dtype)}
    notes = []
    if "llama" in args.model and not args.no_hf:
        try:
            sides["hf"] = Plain(cfg, device, args.batch, args.seq_len, backend, dtype, hf=True)
        except ImportError:
            notes.append("hf: skipped - transformers is not installed here (the plain side runs threefold's llama "
                         "decoder with the same shape instead)")
            print(notes[-1])
    start = time.perf_counter()
    compile_s = {}
    for name, side in sides.items():
        t0 = time.perf_counter()
        run_steps(side, 0, args.warmup)
        sync(device)
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in sides}
    peaks = {name: 0 for name in sides}
    step_mem = {name: 0 for name in sides}
    losses = {name: None for name in sides}
    for r in range(args.rounds):  # alternating rounds, each ended by a synchronisation
        for name, side in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            losses[name] = run_steps(side, args.warmup + r * args.steps, args.steps)
            sync(device)
            times[name].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
                step_mem[name] = max(step_mem[name], torch.cuda.max_memory_allocated(device) - base)
    profiles = {}
    if args.profile_steps > 0:
        first = args.warmup + args.rounds * args.steps
        for name, side in sides.items():
            profiles[name] = profile_summary(side, first, args.profile_steps, device)
    m = cfg.model
    n = count_parameters(m)
    per_token = flops_per_token(m, args.seq_len)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak(dev_name)
    print(f"device={dev_name} torch={torch.__version__} model={args.model} params={n:,} batch={args.batch} "
          f"seq={args.seq_len} dtype={str(dtype).replace('torch.', '')} compile={backend} "
          f"rounds={args.rounds}x{args.steps} peak={peak / 1e12 if peak else float('nan'):.0f}TF")
    result = {"device": dev_name, "torch": torch.__version__, "model": args.model, "params": n, "batch": args.batch,
              "seq_len": args.seq_len, "dtype": str(dtype).replace("torch.", ""), "backend": backend,
              "rounds": args.rounds, "steps_per_round": args.steps, "flops_per_token": per_token,
              "peak_tflops": peak / 1e12 if peak else None, "read": "each step, after the next launch",
              "notes": notes, "sides": {}}
    rate = {}
    for name, ts in times.items():
        per_round = statistics.median(ts)
        rate[name] = args.batch * args.seq_len * args.steps / per_round
        mfu = per_token * rate[name] / peak if peak else None
        result["sides"][name] = {"tokens_per_s": rate[name], "step_s": per_round / args.steps, "mfu": mfu,
                                 "round_s": ts, "warmup_s": compile_s[name], "last_loss": losses[name][0],
                                 "peak_memory_gib": peaks[name] / 2**30 if device.type == "cuda" else None,
                                 "step_memory_gib": step_mem[name] / 2**30 if device.type == "cuda" else None,
                                 "profile": profiles.get(name)}
        mem = f" peak_memory_gib={peaks[name] / 2**30:.2f}" if device.type == "cuda" else ""
        print(f"{name:>10}: tokens_per_s={rate[name]:,.0f} step_s={per_round / args.steps:.4f}"
              f"{f' MFU={mfu:.3f}' if mfu else ''}{mem} (rounds: {', '.join(f'{t:.3f}' for t in ts)} s)")
    for name in rate:
        if name != "threefold":
            result[f"threefold_over_{name}"] = rate["threefold"] / rate[name]
            print(f"threefold / {name} = {rate['threefold'] / rate[name]:.3f}")
    for name, prof in profiles.items():
        print(f"profile {name}: kernels/step={prof['kernels_per_step']} busy={prof['device_busy_fraction']} "
              f"top: {', '.join(k['name'][:40] for k in prof['top'][:5])}")
    result["wall_s"] = time.perf_counter() - start
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
