"""One GPU: threefold's trainer against the plain loop a GPU user would write, side by side, in bf16.

    python bench/gpu_compare.py --model gpt2-124m [--batch 16] [--seq-len 1024] [--rounds 5] [--steps 10]
    python bench/gpu_compare.py --model llama-1b  [--batch 4]  [--seq-len 2048]
    python bench/gpu_compare.py --smoke [--model tiny-llama]   (CPU, tiny, fp32, aot_eager: checks the script)
    options: --json PATH (every figure), --profile-steps 3 (a torch.profiler summary per side),
             --backend (torch.compile backend of every side), --no-hf, --free-gib (size to this, not the device)

Sides, each with its usual settings, in one process, alternating rounds of `--steps` steps:

* **threefold** - `Trainer.launch_step` / `finish_step` (bf16 parameters, fp32 masters, the whole
  step: sampler, forward/backward, gradient norm and clipping, AdamW, metrics record), compiled
  per block (`train.compile=true`);
* **plain** - bench/plain_loop.py, written without threefold's model or loss: fused qkv,
  `F.scaled_dot_product_attention(is_causal=True)`, `F.cross_entropy`, `torch.compile` of the whole
  model, fused AdamW, fp32 weights under bf16 autocast, clipping at 1.0 (the same shape, from
  `shape_of`);
* **hf** (llama models only, when `transformers` is importable and the memory allows) - Hugging Face
  `LlamaForCausalLM` built from a `LlamaConfig` with the same shape, compiled, the plain loop's step.

Memory: every side stays resident (the rounds alternate), so before building them the sides and the
batch are sized to the device's free memory (bench/gpu_stages.py `memory_plan`: bytes per parameter
of each side's state, 20 threefold / 16 plain / 16 hf, plus one side's activations; the Hugging Face
side is dropped first, then the batch halved); the estimate is in the JSON (`memory`).

Every side reads its figures the same way, as threefold's own loop does: step i's figures are read,
in one transfer, after step i+1 was launched, and the last step's at the end of the round. Time is
wall time of each round, host work included, with a device synchronisation at its end (every wait
counted). Rounds alternate the order of the sides; the device's memory peak is reset before each
side's round (`peak_memory_gib`; `step_memory_gib` is the peak above what was allocated when the
round began). tokens/s = batch x seq x steps / time. MFU = FLOP/s / peak, FLOPs per token of each
side's own model 6 N + 12 L h s (N all parameters, L layers, h hidden, s sequence). Peak = the device's
dense bf16 peak: H200 SXM 989 TFLOP/s, H200 NVL 835 (detected from the device name), H100 SXM 989,
A100 312, or `--peak-tflops`. `mfu_threefold_over_plain` is the ratio of the two sides' MFU, defined
without a peak (on CPU too).
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
from gpu_stages import memory_plan  # noqa: E402
from plain_loop import make_plain, shape_of  # noqa: E402
from threefold.config import load_config  # noqa: E402
from threefold.data import Sampler, load_tokens  # noqa: E402
from threefold.models.decoder import count_parameters  # noqa: E402

# A Llama of about 1.24 B parameters (the shape of Llama 3.2 1B: tied embeddings), from the llama preset;
# plain_loop.shape_of("llama-1b") is the same shape
LLAMA_1B = ["model.preset=llama-7b", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=8192", "model.vocab=128256", "model.rope_theta=500000.0", "model.tie_embeddings=true"]
MODELS = {"gpt2-124m": ["model.preset=gpt2-124m"], "llama-1b": LLAMA_1B, "tiny": ["model.preset=tiny"],
          "tiny-llama": ["model.preset=tiny-llama"]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """bench/plain_loop.py's loop (its model, F.cross_entropy, whole-model compile, fused AdamW), fed by the
    same sampler; its step's loss is read after the next launch, as every side's figures are."""

    def __init__(self, model: str, device, batch: int, seq: int, backend: str, vocab: int):
        self.loop = make_plain(shape_of(model), device, compile=True, backend=backend)
        self.sampler = Sampler(load_tokens("synthetic", vocab), seq, batch, seed=0)
        self.device = device

    def flops_per_token(self, seq: int) -> float:
        return self.loop.flops_per_token(seq)

    def launch(self, i: int) -> torch.Tensor:
        b = self.sampler.step_batch(i)
        return self.loop.step(b.inputs.to(self.device, non_blocking=True), b.targets.to(self.device, non_blocking=True))

    def read(self, loss: torch.Tensor) -> list[float]:
        return [loss.item()]


class HfSide:
    """Hugging Face LlamaForCausalLM of the same shape (SDPA), compiled, the plain loop's step."""

    def __init__(self, m, device, batch: int, seq: int, backend: str, dtype):
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
                             num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                             max_position_embeddings=seq, rope_theta=m.rope_theta,
                             tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
        self.model = LlamaForCausalLM(hf_cfg).to(device)
        self.step_model = torch.compile(self.model, backend=backend)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=device.type == "cuda")
        self.sampler = Sampler(load_tokens("synthetic", m.vocab), seq, batch, seed=0)
        self.device, self.dtype = device, dtype

    def flops_per_token(self, seq: int) -> float:
        c = self.model.config
        return 6 * sum(p.numel() for p in self.model.parameters()) + 12 * c.num_hidden_layers * c.hidden_size * seq

    def launch(self, i: int) -> torch.Tensor:
        inputs = self.sampler.step_batch(i).inputs.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.step_model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([loss.detach().float(), norm.float()])

    def read(self, figures: torch.Tensor) -> list[float]:
        return figures.tolist()


class Threefold:
    """`Trainer.launch_step` / `finish_step`: the whole step, read as the trainer's own loop reads it."""

    def __init__(self, overrides: list[str], out: str, m, seq: int):
        from threefold.train.trainer import Trainer

        self.trainer = Trainer(load_config(None, [*overrides, f"run.out={out}", "run.progress=false",
                                                  "run.plot=false", "train.steps=1000000",
                                                  "checkpoint.save_every=0"]))
        self.trainer.observer.start()
        self.per_token = flops_per_token(m, seq)

    def flops_per_token(self, seq: int) -> float:
        return self.per_token

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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per side before timing (compilation)")
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--backend", default=None, help="torch.compile backend of every side (default: inductor "
                        "on CUDA, aot_eager with --smoke)")
    parser.add_argument("--profile-steps", type=int, default=0, help="steps of a torch.profiler summary per side")
    parser.add_argument("--no-hf", action="store_true", help="leave out the Hugging Face side")
    parser.add_argument("--free-gib", type=float, help="size the sides to this much free memory (default: the "
                        "device's free memory on CUDA, no limit on CPU)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--out", default=os.environ.get("WORK", "/tmp/threefold-gpu") + "/compare")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, fp32, aot_eager: checks the script")
    args = parser.parse_args()
    if args.smoke:
        if args.model not in ("tiny", "tiny-llama"):
            args.model = "tiny"
        args.batch, args.seq_len, args.rounds, args.steps, args.warmup = 2, 32, 2, 2, 1
    return args


def build_sides(args, cfg, device, dtype, backend: str) -> tuple[dict, dict]:
    """The sides that fit the memory (memory_plan), and the plan itself (its notes say what was dropped)."""
    m = cfg.model
    free = args.free_gib * 2**30 if args.free_gib else (torch.cuda.mem_get_info(device)[0]
                                                        if device.type == "cuda" else None)
    wanted = ("threefold", "plain") + (("hf",) if "llama" in args.model and not args.no_hf else ())
    plan = memory_plan(count_parameters(m), m.layers, m.hidden, m.ffn_hidden, m.vocab, args.batch, args.seq_len,
                       free, wanted)
    args.batch = plan["batch"]
    overrides = [*MODELS[args.model], f"train.seq_len={args.seq_len}", f"train.global_batch={args.batch}",
                 "train.microbatches=1", "data.source=synthetic",
                 f"precision.compute={'bf16' if dtype == torch.bfloat16 else 'fp32'}",
                 f"run.device={device.type}", "train.compile=true", f"debug.compile_backend={backend}"]
    sides = {"threefold": Threefold(overrides, args.out, m, args.seq_len),
             "plain": Plain(args.model, device, args.batch, args.seq_len, backend, m.vocab)}
    if "hf" in plan["sides"]:
        try:
            sides["hf"] = HfSide(m, device, args.batch, args.seq_len, backend, dtype)
        except ImportError:
            plan["notes"].append("hf: skipped - transformers is not installed here")
    for note in plan["notes"]:
        print(note)
    return sides, plan


def measure(sides: dict, args, device) -> dict:
    """Warm-up (compilation) per side, then alternating timed rounds: each side's round times, memory peaks
    and last figures, and a profile summary per side when asked."""
    found = {name: {"warmup_s": 0.0, "times": [], "peak": 0, "step_mem": 0, "last": None} for name in sides}
    for name, side in sides.items():
        t0 = time.perf_counter()
        run_steps(side, 0, args.warmup)
        sync(device)
        found[name]["warmup_s"] = time.perf_counter() - t0
    for r in range(args.rounds):  # alternating rounds, each ended by a synchronisation
        for name, side in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            found[name]["last"] = run_steps(side, args.warmup + r * args.steps, args.steps)
            sync(device)
            found[name]["times"].append(time.perf_counter() - t0)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                found[name]["peak"] = max(found[name]["peak"], peak)
                found[name]["step_mem"] = max(found[name]["step_mem"], peak - base)
    if args.profile_steps > 0:
        first = args.warmup + args.rounds * args.steps
        for name, side in sides.items():
            found[name]["profile"] = profile_summary(side, first, args.profile_steps, device)
    return found


def report(sides: dict, found: dict, args, device, peak: float | None) -> dict:
    """Each side's tokens/s, step time, MFU and memory, and threefold's ratios to the others, printed and
    returned (the JSON's `sides`, `threefold_over_*`, `mfu`, `mfu_threefold_over_*`)."""
    gib = 2**30 if device.type == "cuda" else None
    result: dict = {"sides": {}, "mfu": {}}
    rate, achieved = {}, {}
    for name, f in found.items():
        per_round = statistics.median(f["times"])
        rate[name] = args.batch * args.seq_len * args.steps / per_round
        achieved[name] = sides[name].flops_per_token(args.seq_len) * rate[name]
        mfu = achieved[name] / peak if peak else None
        result["mfu"][name] = mfu
        result["sides"][name] = {"tokens_per_s": rate[name], "step_s": per_round / args.steps, "mfu": mfu,
                                 "flops_per_token": sides[name].flops_per_token(args.seq_len),
                                 "achieved_tflops": achieved[name] / 1e12, "round_s": f["times"],
                                 "warmup_s": f["warmup_s"], "last_loss": f["last"][0],
                                 "peak_memory_gib": f["peak"] / gib if gib else None,
                                 "step_memory_gib": f["step_mem"] / gib if gib else None, "profile": f.get("profile")}
        mem = f" peak_memory_gib={f['peak'] / gib:.2f}" if gib else ""
        print(f"{name:>10}: tokens_per_s={rate[name]:,.0f} step_s={per_round / args.steps:.4f} "
              f"TFLOP/s={achieved[name] / 1e12:.3g} MFU={f'{mfu:.3f}' if mfu else 'n/a (no peak)'}{mem} "
              f"(rounds: {', '.join(f'{t:.3f}' for t in f['times'])} s)")
    for name in rate:
        if name != "threefold":
            result[f"threefold_over_{name}"] = rate["threefold"] / rate[name]
            result[f"mfu_threefold_over_{name}"] = achieved["threefold"] / achieved[name]
            print(f"threefold / {name}: tokens/s {rate['threefold'] / rate[name]:.3f}, "
                  f"MFU {achieved['threefold'] / achieved[name]:.3f}")
    for name, f in found.items():
        if f.get("profile"):
            prof = f["profile"]
            print(f"profile {name}: kernels/step={prof['kernels_per_step']} busy={prof['device_busy_fraction']} "
                  f"top: {', '.join(k['name'][:40] for k in prof['top'][:5])}")
    return result


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cfg = load_config(None, [*MODELS[args.model], f"train.seq_len={args.seq_len}"])
    sides, plan = build_sides(args, cfg, device, dtype, backend)
    found = measure(sides, args, device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak(dev_name)
    print(f"device={dev_name} torch={torch.__version__} model={args.model} params={count_parameters(cfg.model):,} "
          f"batch={args.batch} seq={args.seq_len} dtype={str(dtype).replace('torch.', '')} compile={backend} "
          f"rounds={args.rounds}x{args.steps} peak={peak / 1e12 if peak else float('nan'):.0f}TF "
          f"memory estimate {plan['total_gib']:.1f} GiB ({', '.join(plan['sides'])})")
    result = {"device": dev_name, "torch": torch.__version__, "model": args.model,
              "params": count_parameters(cfg.model), "batch": args.batch, "seq_len": args.seq_len,
              "dtype": str(dtype).replace("torch.", ""), "backend": backend, "rounds": args.rounds,
              "steps_per_round": args.steps, "flops_per_token": flops_per_token(cfg.model, args.seq_len),
              "peak_tflops": peak / 1e12 if peak else None, "read": "each step, after the next launch",
              "plain": "bench/plain_loop.py", "memory": plan, "notes": plan["notes"],
              **report(sides, found, args, device, peak)}
    result["wall_s"] = time.perf_counter() - start
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
