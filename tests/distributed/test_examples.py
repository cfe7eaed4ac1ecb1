"""Every job file in examples/ trains, on the number of processes its first lines name."""

import math
import re
from pathlib import Path

import pytest

from threefold.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))
SHORT = ["train.steps=2", "run.progress=false", "run.plot=false"]


def nproc_of(path: Path) -> int:
    """The `--nproc N` of the command line in the file's header comment (1 when absent)."""
    found = re.search(r"--nproc (\d+)", path.read_text())
    return int(found.group(1)) if found else 1


def train_example(path: str, overrides: list[str]) -> list[dict]:
    from threefold.train.trainer import train

    return train(load_config(path, overrides))


def test_every_layout_example_trains_two_steps(worlds, tmp_path):
    assert {p.name for p in EXAMPLES} >= {"dp.toml", "tp.toml", "pp.toml", "3d-zero.toml", "resume.toml"}
    for path in EXAMPLES:
        n = nproc_of(path)
        cfg = load_config(path, SHORT).validate(n)  # the header's process count fits the layout
        out = tmp_path / path.stem
        records = worlds(n).run(train_example, str(path), [*SHORT, f"run.out={out}"])[0]
        assert [r["step"] for r in records] == [1, 2], path.name
        assert all(math.isfinite(r["loss"]) for r in records), path.name
        if cfg.checkpoint.resume == "auto":  # run the same file again with more steps: it continues
            again = worlds(n).run(train_example, str(path), ["train.steps=3", "checkpoint.save_every=1",
                                                             "run.progress=false", "run.plot=false",
                                                             f"run.out={out}"])[0]
            assert [r["step"] for r in again] == [3], f"{path.name} did not resume"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_header_names_its_command(path):
    assert f"threefold train --nproc {nproc_of(path)} --config examples/{path.name}" in path.read_text()


def test_the_synthetic_source_is_learnt_visibly_in_twenty_steps(worlds, tmp_path):
    """The README's first multi-process command trains the tiny model 20 steps on `synthetic`
    (losses do not depend on the layout, so one process shows the same curve)."""
    records = worlds(1).run(train_example, None, ["data.source=synthetic", "train.steps=20", "run.progress=false",
                                                  "run.plot=false", f"run.out={tmp_path}"])[0]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.25, (first, last)
