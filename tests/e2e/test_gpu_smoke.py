"""`bash bench/gpu.sh --smoke`: every stage of the one-GPU benchmark on CPU with tiny shapes, so the
script cannot rot between the rare runs on a GPU: it ends 0 (about 80 s idle; the training stages without the launcher), every stage has its
exit code in status.tsv (0 here; "skip" only for a stage the budget leaves out), everything
printed is in gpu.log and every stage's figures are in results.json."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from threefold.planner.hardware import load_gpu

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["preflight", "sync", "gpu-tests", "run-bf16", "run-fp16", "run-zero3", "run-offload", "save", "resume", "bitwise",
          "runs-figures", "gpt2-train", "gpt2-train-figures", "gpt2-compare", "fp8-gemm", "planner-kernels", "fp8-bf16",
          "fp8-train", "fp8-figures", "llama-compare"]


def run_smoke(out: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--smoke", *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    return run, time.monotonic() - start


def status(out: Path) -> dict[str, str]:
    lines = (out / "status.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["stage", "rc", "seconds", "note"]
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines[1:]}


@pytest.mark.slow
def test_gpu_sh_smoke_runs_every_stage_and_writes_its_files(tmp_path):
    out = tmp_path / "gpu"
    # the budget guards a GPU lease; here every stage must run, on a shared machine too (the default 540 s
    # left the last stage out at load 8: 489 s beside the suite and two busy loops)
    run, seconds = run_smoke(out, "--budget", "3600", timeout=3600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    # about 80 s on an idle 2-core machine; the bound leaves room for one shared with other jobs
    assert seconds < 1800, f"--smoke took {seconds:.0f} s"
    codes = status(out)
    assert list(codes) == STAGES and all(rc == "0" for rc in codes.values()), codes
    log = (out / "gpu.log").read_text()
    assert all(f"== {name}: exit 0" in log for name in STAGES), log[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["smoke"] is True and results["budget_s"] == 3600
    assert {k: v["rc"] for k, v in results["status"].items()} == codes
    assert results["preflight"]["ok"] and results["preflight"]["tiny_compile"] == "ok"
    assert results["preflight"]["cc"] and results["preflight"]["python_h"]
    assert results["sync"]["syncs_per_step"] == {"dp": "n/a", "zero3": "n/a", "bf16": "n/a", "fp16": "n/a"}
    assert results["save_resume"]["bitwise"] and results["save_resume"]["resumed_steps"] == [4, 5, 6]
    assert set(results["runs"]) == {"bf16", "fp16", "zero3", "offload"}
    assert all(r["finite"] and r["steps"] == 6 and r["tokens_per_s"] > 0 for r in results["runs"].values())
    assert results["gpt2_train"]["steps"] == 5 and results["gpt2_train"]["tokens_per_s"] > 0
    assert results["fp8_gemm"]["emulated"] and len(results["fp8_gemm"]["rows"]) == 2
    kernels = results["planner_kernels"]
    assert kernels["smoke"] and len(kernels["rows"]) == 2 * (4 * 3 + 2)  # 2 layers: 4 linears x 3 GEMMs, attention
    assert all(r["seconds"] > 0 and r["model_s"] > 0 for r in kernels["rows"])
    measured = load_gpu(str(out / "measured-gpu.toml"))  # the preset with the measured shares, a kind of its own
    assert measured.name == "h100-80gb measured (cpu)" and measured.gemm_efficiency > 0
    assert all(results["fp8_train"][side]["tokens_per_s"] > 0 for side in ("bf16", "fp8")), results["fp8_train"]
    for key in ("gpt2_compare", "llama_compare"):
        sides = results[key]["sides"]
        assert {"threefold", "plain"} <= set(sides) and results[key]["threefold_over_plain"] > 0, results[key]
        assert results[key]["read"] == "each step, after the next launch"
    profile = results["gpt2_compare"]["sides"]["threefold"]["profile"]
    assert profile["steps"] == 3 and profile["top"] and profile["device_busy_fraction"] == "n/a"


def test_gpu_sh_refuses_a_bad_budget_and_skips_what_the_budget_leaves_out(tmp_path):
    run, _ = run_smoke(tmp_path / "a", "--budget", "soon", timeout=60)
    assert run.returncode == 2 and "--budget must be whole seconds" in run.stderr
    # 3 s, less than the 5 s kept for the results: every stage is skipped, says so with 0 s left (never a
    # negative figure, however slow the machine), and the files are written
    run, _ = run_smoke(tmp_path / "b", "--budget", "3", timeout=120)
    codes = status(tmp_path / "b")
    assert run.returncode == 0 and list(codes) == STAGES and set(codes.values()) == {"skip"}, codes
    assert "== llama-compare: skipped, 0s of the budget left, it needs 150s" in (tmp_path / "b" / "gpu.log").read_text()
    assert "-" not in "".join(line.split("\t")[3] for line in (tmp_path / "b" / "status.tsv").read_text().splitlines()[1:])
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["budget_s"] == 3 and results["sync"] is None and results["status"]["sync"]["rc"] == "skip"


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path):
    """Every stage fails (an interpreter that exits 3 for all but the final merge): gpu.sh still runs each
    one, records 3 for each, writes results.json and ends non-zero."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *"gpu_checks.py merge"*) exec "{sys.executable}" "$@" ;; esac\n'
                      'echo "stage failed on purpose" >&2\nexit 3\n')
    python.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=str(python))
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--smoke"], capture_output=True, text=True,
                         timeout=120, env=env)
    codes = status(tmp_path / "out")
    assert run.returncode == 1 and list(codes) == STAGES and set(codes.values()) == {"3"}, (codes, run.stdout[-2000:])
    assert (tmp_path / "out" / "gpu.log").read_text().count("stage failed on purpose") == len(STAGES)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["status"]["llama-compare"]["rc"] == "3"


def test_gpu_sh_only_runs_the_selected_stages(tmp_path):
    """--only splits one lease into calls: the named stages (shell patterns) run, the others are recorded
    as not selected, and results.json is written for what ran."""
    run, _ = run_smoke(tmp_path / "a", "--only", "pre*,gpu-tests", timeout=300)
    codes = status(tmp_path / "a")
    assert run.returncode == 0 and list(codes) == STAGES, (codes, run.stdout[-2000:])
    assert codes["preflight"] == "0" and codes["gpu-tests"] == "0", codes
    assert {codes[name] for name in STAGES if name not in ("preflight", "gpu-tests")} == {"skip"}, codes
    notes = {line.split("\t")[0]: line.split("\t")[3] for line in (tmp_path / "a" / "status.tsv").read_text().splitlines()[1:]}
    assert notes["llama-compare"] == "not selected (--only)"
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["preflight"]["ok"] and results["sync"] is None


def test_gpu_sh_refuses_an_only_pattern_that_names_no_stage(tmp_path):
    """A typo in --only would skip its stage and end 0 on a lease that cannot be repeated: refused before
    anything runs, naming the pattern and the stages."""
    run, _ = run_smoke(tmp_path / "a", "--only", "pre*,lama-compare", timeout=60)
    assert run.returncode == 2, run.stderr
    assert "--only 'lama-compare' matches no stage" in run.stderr and "llama-compare" in run.stderr, run.stderr
    assert not (tmp_path / "a").exists()  # nothing ran, nothing written
