"""Run the `threefold` command line as a user would, in a child process."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def threefold(*args: str, timeout: float = 600, script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m threefold ARGS`, or `python -c SCRIPT ARGS` (a script that ends in threefold's main)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    entry = ["-m", "threefold"] if script is None else ["-c", script]
    return subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
