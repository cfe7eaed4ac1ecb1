"""The planner's kernel model against the GPU at hand: bf16 GEMMs and fused causal attention, by shape.

The planner prices a block by the shapes of its matmuls (planner/compute.py): `gemm_seconds` (the
preset's large-GEMM share of the peak, `Gpu.gemm_efficiency`, times tile and wave quantization, or the
HBM roofline, plus a fixed cost per GEMM) and `attention_seconds` (forward and backward at a published
kernel table's TFLOP/s, `Gpu.attention_table`, or at `Gpu.attention_efficiency`). Those shares are published measurements (planner/hardware.py), not
measurements of this machine. This bench measures them here, for the layers of the validation set's
models (tests/unit/test_planner_validation.py, docs/planner.md): each model's four linears on one tp
rank - the forward, input-gradient and weight-gradient GEMMs in the layouts autograd gives cuBLAS - and
causal SDPA forward and backward at its heads and sequence. It prints the measured TFLOP/s beside the
model's (kernels only: `compute_efficiency`, the training-loop share, not applied) and measured / model.

A ratio below 1 is a kernel the planner thinks faster than it is. Their spread over K (the GEMMs of a
hidden-2048 model against a hidden-16384 one) is what the model's shape terms leave out; the JSON
(`--json`) is the per-GPU calibration set docs/planner.md asks for, disjoint from the validation runs.
`--smoke`: tiny shapes on the CPU, only to keep the script working (the ratios mean nothing there).

`--toml PATH` writes the compared preset as a GPU kind of its own with the measured shares: its
`gemm_efficiency` times the median of measured / model, its `attention_efficiency` the flat share of the peak that
gives the measured attention forward + backward (no `attention_table`: the measurement replaces the published
one), its `sms` this GPU's.
`threefold plan --gpu PATH` then plans with them, and
`python -m tests.unit.test_planner_validation --gpu PATH` prints the validation table with them on the
rows of the preset's kind.

    python bench/planner_kernels.py [--preset auto] [--repeats 20] [--json PATH] [--toml PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F


def layers(smoke: bool) -> list[tuple[str, object, int, int, int]]:
    """(label, ModelConfig, tp, micro-batch, sequence) of the validation set's layers (their published tp)."""
    from threefold.config import load_config

    def preset(name, **changes):
        return replace(load_config(None, [f"model.preset={name}"]).model, **changes)

    def gpt(hidden, heads, seq):
        return preset("gpt3-175b", hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden, max_seq=seq)

    if smoke:
        return [("tiny gpt", gpt(64, 4, 32), 1, 2, 32), ("tiny llama", preset("tiny-llama"), 2, 1, 32)]
    return [
        ("MCore 1.7B (h 2048)", gpt(2048, 16, 4096), 1, 1, 4096),
        ("MCore 7.1B (h 4096)", gpt(4096, 32, 4096), 2, 1, 4096),
        ("MCore 32B (h 7168)", gpt(7168, 56, 4096), 8, 1, 4096),
        ("MCore 314B (h 16384)", gpt(16384, 128, 4096), 8, 1, 4096),
        ("GPT-3 175B (h 12288)", gpt(12288, 96, 2048), 8, 1, 2048),
        ("Llama 3 8B", preset("llama-7b", kv_heads=8, ffn_hidden=14336, max_seq=8192), 1, 1, 8192),
        ("Llama 3 405B", preset("llama-405b", max_seq=8192), 8, 1, 8192),
    ]


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn`, the median of `repeats` calls after two warm-ups (CUDA events on a GPU)."""
    fn(), fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def gemm_rows(m, rows: int, tp: int, gpu, device, repeats: int) -> list[dict]:
    """The three GEMMs of each linear of a block on a tp rank, measured and modelled."""
    from threefold.planner.compute import block_linear_shapes, gemm_seconds

    out = []
    for name, (mm, k, n) in block_linear_shapes(m, rows, tp).items():
        x = torch.randn(mm, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        g = torch.randn(mm, n, device=device, dtype=torch.bfloat16)
        # (kind, the call as autograd makes it, the model's (M, N, K))
        for kind, fn, shape in (("forward", lambda: x @ w.t(), (mm, n, k)),
                                ("input grad", lambda: g @ w, (mm, k, n)),
                                ("weight grad", lambda: g.t() @ x, (n, k, mm))):
            seconds = timed(fn, device, repeats)
            model = gemm_seconds(*shape, gpu)
            flops = 2.0 * mm * n * k
            out.append({"linear": name, "gemm": kind, "m": shape[0], "n": shape[1], "k": shape[2],
                        "seconds": seconds, "model_s": model, "tflops": flops / seconds / 1e12,
                        "model_tflops": flops / model / 1e12, "measured_over_model": model / seconds})
        del x, w, g
    return out


def attention_rows(m, micro_batch: int, seq: int, tp: int, gpu, device, repeats: int) -> list[dict]:
    """Causal SDPA forward and forward + backward of a tp rank's heads, measured and modelled."""
    from threefold.planner.compute import attention_seconds, executed_attention_flops

    heads, kv = max(1, m.heads // tp), max(1, m.kv_heads // tp)
    shape = (micro_batch, heads, seq, m.head_dim)
    q = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(micro_batch, kv, seq, m.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn(*shape, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)

    def both():  # gradients returned, not accumulated into .grad (no extra kernel)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
        torch.autograd.grad(out, (q, k, v), grad)

    rows = micro_batch * seq
    fwd_model, bwd_model = attention_seconds(m, rows, seq, tp, "flash", gpu, "bf16")
    flops = executed_attention_flops(m, rows, seq, tp, "flash")  # the forward's, as the planner counts them
    fwd = timed(forward, device, repeats)
    total = timed(both, device, repeats)
    out = []
    # FlashAttention's backward runs 2.5x its forward's FLOPs; `share`: the flat share of the peak that gives
    # the measured forward + backward (a measured kind's attention_efficiency, which replaces the published table)
    share = 3 * flops / max(total, 1e-12) / gpu.peak_flops
    for kind, seconds, model, f in (("attention forward", fwd, fwd_model, flops),
                                    ("attention backward", total - fwd, bwd_model, 2.5 * flops)):
        out.append({"linear": "attention", "gemm": kind, "m": rows, "n": seq, "k": m.head_dim, "seconds": seconds,
                    "model_s": model, "tflops": f / seconds / 1e12, "model_tflops": f / model / 1e12,
                    "measured_over_model": model / seconds, "share": share})
    return out


def gpu_preset(name: str, device_name: str):
    from threefold.planner.hardware import PRESETS, fp8_gpu

    if name != "auto":
        return PRESETS[name]
    return fp8_gpu(device_name) or PRESETS["a100-80gb" if "a100" in device_name.lower() else "h100-80gb"]


def write_measured(path: Path, gpu, device_name: str, sms: int | None, summary: dict) -> None:
    """The preset as a GPU kind with this GPU's measured kernel shares: the GEMM plateau times the median of
    measured / model, the attention's flat share of the peak that gives its measured forward + backward (no
    published attention table: the measurement replaces it)."""
    from threefold.planner.hardware import gpu_toml

    measured = replace(gpu, name=f"{gpu.name} measured ({device_name})", sms=sms or gpu.sms,
                       gemm_efficiency=gpu.gemm_efficiency * summary["gemm_median"],
                       attention_efficiency=summary["attention_share"], attention_table="")
    path.write_text(gpu_toml(measured, f"bench/planner_kernels.py on {device_name}, torch {torch.__version__}: "
                                       f"{gpu.name} with the kernel shares measured here (write_measured)"))
    print(f"measured kind: {path} (threefold plan --gpu {path})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auto", help="the planner's GPU preset to compare with (auto: by name)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="")
    parser.add_argument("--toml", default="", help="write the preset with the measured shares as a GPU kind")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu = gpu_preset(args.preset, device_name)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    print(f"{device_name} ({sms or '-'} SMs) against the planner's {gpu.name} ({gpu.sms} SMs, gemm "
          f"{gpu.gemm_efficiency}, attention {gpu.attention_efficiency} of {gpu.peak_flops / 1e12:.0f} TFLOP/s)")
    print(f"{'layer':<22} {'kernel':<12} {'gemm':<19} {'M':>6} {'N':>6} {'K':>6} {'TFLOP/s':>8} {'model':>7} "
          f"{'meas/model':>10}")
    table = []
    for label, m, tp, micro_batch, seq in layers(args.smoke):
        rows = gemm_rows(m, micro_batch * seq, tp, gpu, device, args.repeats) \
            + attention_rows(m, micro_batch, seq, tp, gpu, device, args.repeats)
        for r in rows:
            r.update(layer=label, tp=tp)
            print(f"{label:<22} {r['linear']:<12} {r['gemm']:<19} {r['m']:>6} {r['n']:>6} {r['k']:>6} "
                  f"{r['tflops']:>8.1f} {r['model_tflops']:>7.1f} {r['measured_over_model']:>10.2f}", flush=True)
        table += rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gemms = [r["measured_over_model"] for r in table if r["linear"] != "attention"]
    attention = [r["measured_over_model"] for r in table if r["linear"] == "attention"]
    by_k: dict[int, list[float]] = {}
    for r in table:
        if r["linear"] != "attention":
            by_k.setdefault(r["k"], []).append(r["measured_over_model"])
    summary = {"gemm_median": statistics.median(gemms), "gemm_min": min(gemms), "gemm_max": max(gemms),
               "attention_median": statistics.median(attention),
               "attention_share": statistics.median(r["share"] for r in table if r["gemm"] == "attention forward"),
               "gemm_median_by_k": {k: statistics.median(v) for k, v in sorted(by_k.items())}}
    print(f"measured / model: GEMMs median {summary['gemm_median']:.2f} (min {summary['gemm_min']:.2f}, "
          f"max {summary['gemm_max']:.2f}); attention median {summary['attention_median']:.2f}")
    print("GEMMs by K (the summed dimension), median measured / model: "
          + ", ".join(f"{k}: {v:.2f}" for k, v in summary["gemm_median_by_k"].items()))
    if args.toml:
        write_measured(Path(args.toml), gpu, device_name, sms, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "sms": sms, "preset": gpu.name, "repeats": args.repeats,
                       "torch": torch.__version__, "smoke": args.smoke, "summary": summary, "rows": table}, f,
                      indent=1)


if __name__ == "__main__":
    main()
