"""ZeRO-3 builds a model no rank ever holds whole (parallel/materialise.py `Deferred`, zero3.py).

Four child processes (tests/zero3_build_memory.py) form a dp=4 world and build a ZeRO-3 Trainer of
a model of 455 MB in fp32, in bf16 with fp32 masters. What a rank keeps once built is its quarter
of everything (bf16 shards and gradients, fp32 masters and two moments: 16 bytes per parameter / 4,
the whole model's fp32 bytes again). Built whole first (the model in fp32, then the fp32 copy mixed
precision keeps for the masters) the build's peak exceeds that by the whole model (454 MB measured);
unit by unit by the masters' fp32 values while they are copied (a quarter of the model, 114 MB) and
one unit being filled (28 MB). The peak resident set above the interpreter's baseline (VmHWM; glibc
made to map and unmap each large tensor with MALLOC_MMAP_THRESHOLD_) exceeds what stays resident by
less than half the model on every rank. That the values are the ones the whole build gives is what
the ZeRO-3 parity tests show (tests/distributed/test_zero*.py, against one process and a plain loop)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model.preset=tiny", "model.layers=16", "model.hidden=768", "model.heads=12", "model.kv_heads=12",
         "model.ffn_hidden=3072", "model.vocab=256", "train.steps=1", "train.global_batch=4", "train.seq_len=16",
         "parallel.dp=4", "parallel.zero=3", "precision.compute=bf16"]


def test_zero3_build_never_holds_the_whole_model(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 4
    env = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen([sys.executable, "-m", "tests.zero3_build_memory", str(tmp_path / "out"), *MODEL],
                                 env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-2000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    whole = reports[0]["whole_fp32"]
    assert whole > 400 * 2**20, whole
    for rank, report in enumerate(reports):
        assert report["peak_above_base"] - report["kept_above_base"] < whole / 2, (rank, report)
