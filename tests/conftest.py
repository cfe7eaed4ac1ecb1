"""Shared fixtures. `worlds(n)` hands out a gloo world of n processes that lives for the whole
test session, so the many multi-process checks pay for starting processes only once per size."""

import os

# One torch thread per process unless the caller says otherwise: `make test` runs two pytest workers,
# each with worlds of processes, on a 2-core machine, and torch's default (a thread per core in every
# process) oversubscribes it; its idle threads spin, on a busy machine for most of the CPU time
# (tests/unit/test_fp8.py + test_remat.py: 41 CPU-s with 2 threads, 24 with 1, the same results).
# Set before torch is imported; the worlds' processes and the CLI runs inherit it (run.threads
# reads it, tests/distributed/test_threads.py sets and clears it itself).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from threefold.launch.world import World  # noqa: E402
from threefold.train.threads import choose_cpu_threads  # noqa: E402

# in case torch came first: the count run.threads reads from the same variable
torch.set_num_threads(choose_cpu_threads(0, os.environ["OMP_NUM_THREADS"], os.cpu_count() or 1, 1)[0])


class Worlds:
    def __init__(self):
        self._worlds: dict[int, World] = {}

    def __call__(self, size: int) -> World:
        if size not in self._worlds:
            self._worlds[size] = World(size, timeout_s=900)
        return self._worlds[size]

    def close(self):
        """Kill the ranks: nothing of theirs is kept, and a graceful leave (a destroyed process group per
        rank, a grace period per world) cost 20 s when the suite moved on from tests/distributed."""
        for world in self._worlds.values():
            world.close(force=True)
        self._worlds.clear()


_POOL = Worlds()


@pytest.fixture(scope="session")
def worlds():
    yield _POOL
    _POOL.close()


# Files that take longest on their own, started first so that neither worker of `make test`
# (pytest-xdist, `-n 2 --dist loadfile`: whole files to each worker) is left with a long file at the end.
SLOW_FIRST = ["tests/e2e/test_gpu_smoke.py", "tests/e2e/test_multinode.py", "tests/e2e/test_preempt.py",
              "tests/e2e/test_recovery.py", "tests/e2e/test_plan_cli.py", "tests/e2e/test_hf_cli.py",
              "tests/e2e/test_train_cli.py", "tests/unit/test_schedules.py", "tests/e2e/test_run_lock.py"]


def pytest_collection_modifyitems(config, items):
    """tests/distributed first (their worlds start once per worker and stay up while they run), then the
    slow files, then the rest; each file keeps its own order."""
    root = config.rootpath
    slow = {path: i for i, path in enumerate(SLOW_FIRST)}

    def rank(item) -> int:
        return -1 if item.path.parent.name == "distributed" else slow.get(item.path.relative_to(root).as_posix(),
                                                                           len(slow))

    items.sort(key=rank)


def pytest_runtest_setup(item):
    """Idle worlds are not free (their processes and gloo threads share the machine's cores), so
    they are closed before any test outside tests/distributed (those launch their own processes or
    need none)."""
    if item.path.parent.name != "distributed":
        _POOL.close()


@pytest.fixture
def alone():
    """A world of one in this test's process, left as it was found (the variables it sets would make
    a later in-process `threefold train` believe it runs under a launcher)."""
    import torch.distributed as dist

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

