"""Shared fixtures. `worlds(n)` hands out a gloo world of n processes that lives for the whole
test session, so the many multi-process checks pay for starting processes only once per size."""

import pytest

from threefold.world import World


class Worlds:
    def __init__(self):
        self._worlds: dict[int, World] = {}

    def __call__(self, size: int) -> World:
        if size not in self._worlds:
            self._worlds[size] = World(size, timeout_s=900)
        return self._worlds[size]

    def close(self):
        for world in self._worlds.values():
            world.close(force=False)


@pytest.fixture(scope="session")
def worlds():
    pool = Worlds()
    yield pool
    pool.close()
