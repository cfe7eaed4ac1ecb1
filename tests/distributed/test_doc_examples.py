"""The python blocks of README.md and docs/*.md that name everything they use run as written.

A block runs as a script (`__name__ == "__main__"`) in a fresh directory holding a tiny job.toml.
The World it starts is the suite's world of that size (tests/conftest.py), its ranks working in
the block's directory as a World started there would: the block's own code, its config keys and
the records it reads are what is tested, not the start of new processes (tests/unit/test_world_of_one.py
and the distributed tests cover World itself).
"""

import ast
import os

import pytest

import threefold.launch.world
from tests.doc_blocks import blocks, unbound_names

RUNNABLE = [b for b in blocks() if b.lang == "python" and not unbound_names(ast.parse(b.text))]
JOB = """[model]
preset = "tiny"
[train]
global_batch = 4
seq_len = 16
[data]
source = "synthetic"
[run]
progress = false
plot = false
"""


def _in_directory(path: str, fn, args, kwargs):
    here = os.getcwd()
    os.chdir(path)
    try:
        return fn(*args, **kwargs)
    finally:
        os.chdir(here)


class _SuiteWorld:
    """`World(n)` of a block: the suite's world of n ranks, run in the block's directory, left open."""

    def __init__(self, world):
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, fn, *args, **kwargs):
        return self.world.run(_in_directory, os.getcwd(), fn, args, kwargs)


def test_the_readme_library_example_is_runnable():
    assert any(b.path.name == "README.md" and "World(" in b.text for b in RUNNABLE)


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where)
def test_runnable_python_blocks_run(block, worlds, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(threefold.launch.world, "World", lambda size, **kw: _SuiteWorld(worlds(size)))
    (tmp_path / "job.toml").write_text(JOB)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__main__"})
    if "World(" in block.text and "train.steps=10" in block.text:  # the README's: 10 steps, reported
        assert "10 steps, final loss" in capsys.readouterr().out
        assert len((tmp_path / "runs" / "library" / "metrics.jsonl").read_text().splitlines()) == 10
