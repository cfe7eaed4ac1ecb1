"""The checks and figures of `bench/gpu.sh` that are not a training run, one subcommand each.

    python bench/gpu_checks.py preflight --json P [--smoke]   versions, triton, cc, Python.h, one tiny compile
    python bench/gpu_checks.py sync --json P [--smoke]        host syncs inside a step: dp, ZeRO-3, bf16, fp16
    python bench/gpu_checks.py summary --json P NAME=RUN...   figures of finished `threefold train` runs
    python bench/gpu_checks.py bitwise --json P A B --step N  a resumed run's checkpoint equals the whole run's
    python bench/gpu_checks.py merge OUT --work W             W/results/*.json + OUT/status.tsv -> OUT/results.json;
                                                              OUT keeps at most 8 files, none in a folder

Each writes its figures as JSON (`--json`) and exits non-zero when its check fails, so gpu.sh records
the failure in status.tsv and goes on. Nothing here needs pytest: the GPU machine has none. Only
preflight and sync import torch (and summary on a CUDA run, for the device's name): summary, bitwise
and merge read files, and start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_stages  # noqa: E402  (bench/, beside this script: no torch)

# stages whose figures results.json carries under these keys (gpu.sh writes WORK/results/<key>.json)
RESULT_KEYS = ("preflight", "sync", "runs", "save_resume", "gpt2_train", "gpt2_compare", "fp8_gemm",
               "planner_kernels", "fp8_train", "llama_compare")


PEAKS = [("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12),
         ("B200", 2250e12)]


def device_peak(name: str) -> float | None:
    """The device's dense bf16 peak (FLOP/s) from its name, None when unknown."""
    return next((peak for key, peak in PEAKS if key in name), None)


def flops_per_token(m, seq: int) -> int:
    """6 N + 12 L h s: forward and backward of every weight, plus attention scores and values
    (N from planner/workload.py, equal to models/decoder.py count_parameters without building the model)."""
    from threefold.planner.workload import total_parameters

    return 6 * total_parameters(m) + 12 * m.layers * m.hidden * seq


def write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(json.dumps(data, default=str))


def device(smoke: bool) -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


# ------------------------------------------------------------------ preflight


def version(name: str) -> str | None:
    """An importable package's version, from its metadata when it has some (then nothing is imported:
    transformers alone takes a second); None when it is not there."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        try:
            return getattr(__import__(name), "__version__", "unknown")
        except ImportError:
            return None


def device_memory(dev) -> dict:
    """The device's free and total memory, and what llama-compare will keep of its sides and batch there
    (gpu_stages.memory_plan on the 1.24B Llama at batch 4 x 2048, the sizing gpu_compare.py applies)."""
    import torch

    if dev.type != "cuda":
        return {"memory_free_gib": None, "memory_total_gib": None, "llama_compare_memory": None}
    free, total = torch.cuda.mem_get_info(dev)
    s = gpu_stages.LLAMA_1B
    plan = gpu_stages.memory_plan(int(gpu_stages.parameters(s)), s["layers"], s["hidden"], s["ffn"], s["vocab"], 4,
                                  2048, free)
    print(f"device memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}; llama-compare: sides "
          f"{', '.join(plan['sides'])}, batch {plan['batch']}, estimate {plan['total_gib']:.1f} GiB"
          + "".join(f"; {n}" for n in plan["notes"]))
    return {"memory_free_gib": free / 2**30, "memory_total_gib": total / 2**30, "llama_compare_memory": plan}


def preflight(args) -> int:
    import torch

    dev = device(args.smoke)
    found: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                   "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()  # a tuple (an int in older torch)
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        found["nccl"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,memory.total,driver_version,clocks.max.sm,power.limit,mig.mode.current"
        run = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        found["nvidia_smi"] = (run.stdout or run.stderr).strip()
    else:
        found["nvidia_smi"] = None
    found["triton"] = version("triton")
    found["cc"] = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found["python_h"] = str(header) if header.exists() else None
    for name in ("transformers", "pytest", "safetensors", "numpy", "torchao"):
        found[name] = version(name)
    found["send_along"] = gpu_stages.send_along(gpu_stages.stage_rows())
    found.update(device_memory(dev))
    # one tiny inductor compile on the device: triton code generation end to end; --smoke: aot_eager, the
    # compile path of the other smoke stages (a cold inductor C++ compile alone takes 15 s on 2 cores)
    found["tiny_compile_backend"] = backend = "aot_eager" if args.smoke else "inductor"
    start = time.perf_counter()
    try:
        fn = torch.compile(lambda x: (x.sin() * 2 + 1).sum(), backend=backend, dynamic=False)
        x = torch.randn(64, device=dev)
        ok = torch.allclose(fn(x), (x.sin() * 2 + 1).sum())
        found["tiny_compile"] = "ok" if ok else "wrong result"
    except Exception as exc:  # the figure is the failure itself: gpu.sh goes on with the next stage
        found["tiny_compile"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    found["tiny_compile_s"] = round(time.perf_counter() - start, 2)
    needed = [found["cc"], found["python_h"], found["tiny_compile"] == "ok"]
    if dev.type == "cuda":
        needed.append(found["triton"])
    found["ok"] = all(needed)
    write(args.json, found)
    return 0 if found["ok"] else 1


# ------------------------------------------------------------------ host syncs inside a step

SYNC_CASES = {"dp": ["precision.compute=fp32"], "zero3": ["parallel.zero=3"], "bf16": ["precision.compute=bf16"],
              "fp16": ["precision.compute=fp16"]}


def syncs_per_step(overrides: list[str], out: str, dev: torch.device, steps: int = 3) -> float | str:
    """The blocking device-to-host waits torch's sync debug mode reports inside one step (its mean over
    `steps` steps after two warm-up steps); "n/a" off CUDA (the step runs, nothing is counted)."""
    import torch

    from threefold.config import load_config
    from threefold.train.trainer import Trainer

    cfg = load_config(None, [f"run.out={out}", "run.progress=false", "run.plot=false", "model.preset=tiny",
                             "train.global_batch=8", "train.seq_len=32", "train.steps=100", "data.prefetch=0",
                             f"run.device={dev.type}", *overrides])
    trainer = Trainer(cfg)
    try:
        for _ in range(2):
            trainer.train_one_step()
        counted = 0
        for i in range(steps):
            step = trainer.step + 1 + i
            micro_batches, _ = trainer.loader.get(step - 1)
            if dev.type != "cuda":
                trainer.step_fn(step, micro_batches, trainer.global_tokens).read()
                continue
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = trainer.step_fn(step, micro_batches, trainer.global_tokens)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counted += sum("synchroniz" in str(w.message) for w in caught)
            result.read()
        return counted / steps if dev.type == "cuda" else "n/a"
    finally:
        trainer.loader.close()


def sync(args) -> int:
    dev = device(args.smoke)
    found, failed = {}, False
    for name, overrides in SYNC_CASES.items():
        try:
            found[name] = syncs_per_step(overrides, f"{args.scratch}/{name}", dev)
        except Exception as exc:
            found[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        failed |= found[name] not in (0, 0.0, "n/a")
        print(f"sync {name}: {found[name]}", flush=True)
    write(args.json, {"syncs_per_step": found, "expected": 0, "device": dev.type, "ok": not failed})
    return 1 if failed else 0


# ------------------------------------------------------------------ finished runs


def run_figures(run: Path, skip: int, peak_tflops: float | None) -> dict:
    from threefold.config import load_config
    from threefold.train.metrics import read_metrics

    rows = read_metrics(run / "metrics.jsonl")
    timed = rows[skip:] if len(rows) > skip else rows[1:] or rows  # short runs: all but the first
    tokens_per_s = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
    figures = {"steps": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
               "finite": all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
               "skipped_steps": sum(bool(r.get("skipped")) for r in rows),
               "tokens_per_s": tokens_per_s, "step_s_median": statistics.median(r["step_time_s"] for r in timed),
               "peak_memory_bytes": max(r["mem"]["peak"] for r in rows), "timed_steps": len(timed)}
    cfg = load_config(run / "config.toml")
    figures["flops_per_token"] = flops_per_token(cfg.model, cfg.train.seq_len)
    name = "cpu"
    if cfg.run.device == "cuda":
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = peak_tflops * 1e12 if peak_tflops else device_peak(name)
    figures["mfu"] = figures["flops_per_token"] * tokens_per_s / peak if peak else None
    figures["peak_tflops"] = peak / 1e12 if peak else None
    return figures


def summary(args) -> int:
    found, failed = {}, False
    for item in args.runs:
        name, _, run = item.partition("=")
        try:
            found[name] = run_figures(Path(run), args.skip, args.peak_tflops)
            failed |= not found[name]["finite"]
        except (OSError, KeyError, ValueError) as exc:
            found[name] = f"failed: {type(exc).__name__}: {exc}"
            failed = True
    write(args.json, found if len(found) > 1 or not args.flat else next(iter(found.values())))
    return 1 if failed else 0


def safetensors_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """A .safetensors file's tensors as (dtype, shape, bytes), read without torch: an 8-byte little-endian
    header length, the JSON header (offsets into the data that follows), the data."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    body = data[8 + size:]
    return {key: (t["dtype"], t["shape"], body[t["data_offsets"][0]:t["data_offsets"][1]])
            for key, t in header.items()}


def bitwise(args) -> int:
    """The checkpoint of step N of a run resumed from an async save equals the uninterrupted run's, tensor
    for tensor, byte for byte, and the resumed steps' losses are the uninterrupted ones."""
    from threefold.train.metrics import read_metrics

    whole, resumed = Path(args.whole), Path(args.resumed)
    step = f"step-{args.step:08d}"  # checkpoint/format.py step_dir_name (which imports torch)
    files = sorted((whole / "checkpoints" / step).glob("*.safetensors"))
    differ, tensors = [], 0
    for f in files:
        a, b = safetensors_tensors(f), safetensors_tensors(resumed / "checkpoints" / step / f.name)
        if set(a) != set(b):
            differ.append(f"{f.name}: keys {sorted(set(a) ^ set(b))[:5]}")
        for key in sorted(set(a) & set(b)):
            tensors += 1
            if a[key] != b[key]:
                differ.append(f"{f.name}:{key}")
    losses = {r["step"]: r["loss"] for r in read_metrics(whole / "metrics.jsonl")}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed / "metrics.jsonl")}
    loss_equal = bool(again) and all(losses.get(s) == v for s, v in again.items())
    ok = bool(files) and not differ and loss_equal
    write(args.json, {"files": len(files), "tensors": tensors, "differing": differ[:20], "resumed_steps": sorted(again),
                      "losses_equal": loss_equal, "bitwise": ok})
    return 0 if ok else 1


KEPT = ("results.json", "gpu.log", "status.tsv", "measured-gpu.toml")  # what gpu.sh writes into OUT
MAX_FILES = 8  # the device runner brings back 8 files of OUT


def keep_out(out: Path, work: Path) -> list[str]:
    """OUT keeps KEPT and at most MAX_FILES files in all, none in a folder (pictures or profiles may take the
    other four places): everything else is moved to WORK/stray, so that what comes back is defined.
    Returns what was moved (empty: the rule held)."""
    entries = sorted(out.iterdir(), key=lambda p: (p.name not in KEPT, p.name))
    places = MAX_FILES - (not (out / "results.json").exists())  # results.json is written after this
    moved = []
    for entry in entries:
        if entry.is_file() and not entry.is_symlink() and places > 0:
            places -= 1
            continue
        moved.append(entry.name + ("/" if entry.is_dir() else ""))
        (work / "stray").mkdir(parents=True, exist_ok=True)
        shutil.move(str(entry), str(work / "stray" / entry.name))
    return moved


def headline(results: dict) -> list[str]:
    """The figures the GPU hour is for, one line each (printed at the end of gpu.log)."""
    lines = []
    for key in ("gpt2_compare", "llama_compare"):
        r = results.get(key)
        if isinstance(r, dict) and "sides" in r:
            mfu = ", ".join(f"{n} {v:.3f}" if v is not None else f"{n} n/a" for n, v in r.get("mfu", {}).items())
            lines.append(f"{key}: MFU {mfu}; threefold / plain: MFU {r.get('mfu_threefold_over_plain', 0):.3f}, "
                         f"tokens/s {r.get('threefold_over_plain', 0):.3f} ({r.get('device')}, batch {r.get('batch')})")
    r = results.get("fp8_gemm")
    if isinstance(r, dict) and r.get("rows"):
        big = max(r["rows"], key=lambda row: row["m"] * row["k"] * row["n"])
        lines.append(f"fp8_gemm: bf16 / fp8 time {big['measured']:.2f}x at {big['m']}x{big['k']}x{big['n']} "
                     f"(model {big['model']:.2f}x){' emulated' if r.get('emulated') else ''}")
    r = results.get("sync")
    if isinstance(r, dict):
        lines.append(f"sync: host syncs per step {r.get('syncs_per_step')}")
    return lines


def merge(args) -> int:
    out, work = Path(args.out), Path(args.work)
    status = {}
    lines = (out / "status.tsv").read_text().splitlines() if (out / "status.tsv").exists() else []
    for line in lines[1:]:
        name, rc, seconds, *note = line.split("\t")
        status[name] = {"rc": rc, "seconds": float(seconds), "note": note[0] if note else ""}
    estimates = {row[0]: {"call": row[1], "estimate_s": gpu_stages.estimate(row), "needs": list(row[6]),
                          "seconds": status.get(row[0], {}).get("seconds")} for row in gpu_stages.stage_rows()}
    results: dict = {"status": status, "smoke": args.smoke, "budget_s": args.budget, "elapsed_s": args.elapsed,
                     "work_dir": str(work), "send_along": args.send, "estimates": estimates}
    for key in RESULT_KEYS:
        path = work / "results" / f"{key}.json"
        try:
            results[key] = json.loads(path.read_text()) if path.exists() else None
        except ValueError as exc:
            results[key] = f"unreadable: {exc}"
    moved = keep_out(out, work)
    results["out_rule"] = (f"broken: moved {', '.join(moved)} to {work / 'stray'}" if moved else
                           f"ok: at most {MAX_FILES} files, none in a folder")
    results["out_files"] = sorted({p.name for p in out.iterdir()} | {"results.json"})
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for line in headline(results):
        print(line)
    print(f"results: {out / 'results.json'}; {out}: {results['out_rule']}")
    return 1 if moved else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("preflight")
    p.add_argument("--json", required=True)
    p.add_argument("--smoke", action="store_true")
    p = sub.add_parser("sync")
    p.add_argument("--json", required=True)
    p.add_argument("--scratch", default=os.environ.get("WORK", "/tmp/threefold-gpu") + "/sync")
    p.add_argument("--smoke", action="store_true")
    p = sub.add_parser("summary")
    p.add_argument("--json", required=True)
    p.add_argument("--skip", type=int, default=3, help="first steps left out of the timing (warm-up, compile)")
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--flat", action="store_true", help="one run: its figures at the top level")
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    p = sub.add_parser("bitwise")
    p.add_argument("--json", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("whole")
    p.add_argument("resumed")
    p = sub.add_parser("merge")
    p.add_argument("out")
    p.add_argument("--work", required=True, help="the work directory: results/<key>.json, where strays go")
    p.add_argument("--send", default="", help="the send-along line of gpu_stages.py")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget", type=float)
    p.add_argument("--elapsed", type=float)
    args = parser.parse_args()
    commands = {"preflight": preflight, "sync": sync, "summary": summary, "bitwise": bitwise, "merge": merge}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
