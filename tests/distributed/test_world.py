"""The test worlds (launch/world.py) fail fast and heal what is not the code's fault: a rank process that
dies without a word fails the call when it is seen, not at the world's timeout (a CI run once waited the
15 minutes of pytest's timeout for a rank that had died at start); a world whose port another process took
between its being found free and rank 0's store binding it (EADDRINUSE) is started again on another port."""

import os
import socket
import time

import pytest

from threefold.launch import world as world_module
from threefold.launch.world import RankError, World


def rank_of_world() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def exit_without_a_word() -> None:
    os._exit(3)


def test_a_rank_that_dies_fails_the_call_at_once():
    with World(2, timeout_s=600) as world:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"exited \(code 3\) without a result"):
            world.run(exit_without_a_word)
        assert time.monotonic() - start < 60  # seen within seconds, not at the 600 s timeout
        assert world.run(rank_of_world) == [0, 1]  # the next call starts a fresh world


def test_a_world_whose_port_is_taken_starts_again_on_another(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # the first start is handed a port another process holds
    real = world_module.free_port

    def free_port() -> int:
        port = ports.pop(0) if ports else real()
        handed.append(port)
        return port

    handed: list[int] = []
    monkeypatch.setattr(world_module, "free_port", free_port)
    try:
        with World(1, timeout_s=300) as world:
            assert world.run(rank_of_world) == [0]
        assert len(handed) == 2 and handed[0] == taken.getsockname()[1]
    finally:
        taken.close()


def preloaded_and_parent() -> tuple[list[str], int]:
    import sys
    return [name for name in world_module.PRELOAD if name not in sys.modules], os.getppid()


def test_ranks_are_forked_with_the_preloaded_modules_imported():
    """A rank is forked from the fork server, which imported PRELOAD once: a fresh rank has them all before
    its first task imports anything (a spawned rank would import torch, its optimizer hooks and transformers
    again, ~12 CPU-s each), and its parent is that server, not this process."""
    with World(1, timeout_s=300) as world:
        [(missing, parent)] = world.run(preloaded_and_parent)
    assert missing == [], f"not imported in a fresh rank: {missing}"
    assert parent != os.getpid()
