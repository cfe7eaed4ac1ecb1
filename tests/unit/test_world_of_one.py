"""A lone process (a notebook, a script calling threefold.prepare) joins a world of one."""
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from threefold.mesh import init_distributed


def test_a_world_of_one_leaves_the_environment_as_it_was(alone):
    """A child started after it (`threefold train` from the same notebook) must not inherit RANK
    without MASTER_ADDR: it would take itself for a launched rank and fail to rendezvous."""
    had = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.pop("RANK", None)
    try:
        init_distributed(torch.device("cpu"))
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('RANK'))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == "None"
    finally:
        for key, value in had.items():
            if value is not None:
                os.environ[key] = value
