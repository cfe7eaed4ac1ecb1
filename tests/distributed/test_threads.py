"""A trained rank runs on the thread count run.threads chose, and the run directory records it."""

import json
import os
from pathlib import Path

import torch

from tests.helpers import make_config

TINY = ["model.preset=tiny", "train.steps=1", "train.global_batch=4", "train.seq_len=16"]


def threads_after_training(out: str, setting: int, omp: str | None) -> int:
    """Train one step with OMP_NUM_THREADS as given (None: unset); torch's thread count afterwards.
    The rank process is shared with other tests: its environment and thread count are restored."""
    from threefold.train.trainer import train

    saved_env, saved_threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        os.environ["OMP_NUM_THREADS"] = omp
    try:
        train(make_config([*TINY, f"run.threads={setting}"], out))
        return torch.get_num_threads()
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved_env is not None:
            os.environ["OMP_NUM_THREADS"] = saved_env
        torch.set_num_threads(saved_threads)


def claimed(path: Path) -> str:
    """A run directory as the CLI leaves it before training: its run file."""
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"run_id": "r1"}))
    return str(path)


def recorded(out: str) -> dict:
    run = json.loads((Path(out) / "run.json").read_text())
    assert run["run_id"] == "r1"  # the entry is added, the run file kept
    return run["threads"]


def test_each_rank_runs_on_the_chosen_threads(worlds, tmp_path):
    world = worlds(2)  # its ranks start with 1 thread (World's default): the first two cases set others
    out = claimed(tmp_path / "omp")
    assert world.run(threads_after_training, out, 0, "3") == [3, 3]
    assert recorded(out) == {"count": 3, "from": "OMP_NUM_THREADS"}
    out = claimed(tmp_path / "set")
    assert world.run(threads_after_training, out, 2, "3") == [2, 2]  # the setting wins over the environment
    assert recorded(out) == {"count": 2, "from": "run.threads"}
    fair = max(1, len(os.sched_getaffinity(0)) // 2)  # this machine's cores shared by the world's 2 processes
    out = claimed(tmp_path / "fair")
    assert world.run(threads_after_training, out, 0, None) == [fair, fair]
    assert recorded(out) == {"count": fair, "from": "cores/local"}
