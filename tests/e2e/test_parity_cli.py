"""`threefold parity`: passes across data-parallel layouts, fails naming a broken layout and step."""

from tests.e2e.cli import threefold

JOB = ["--steps", "3", "--model", "tiny", "--global-batch", "4", "--seq-len", "16"]


def test_parity_passes_on_data_parallel_layouts(tmp_path):
    run = threefold("parity", "--layouts", "1,1,1 2,1,1", *JOB, "--out", str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "parity PASSED" in run.stdout
    assert "rel diff 2,1,1" in run.stdout and "blocks.1.mlp.down.weight" in run.stdout


def test_parity_fails_naming_the_broken_layout_and_step(tmp_path):
    # layout 2,1,1 alone trains on shifted targets from step 2 on: a deliberately broken layout
    run = threefold("parity", "--layouts", "1,1,1 2,1,1", *JOB, "--out", str(tmp_path),
                    "--set", "fault.kind=perturb", "--set", "fault.rank=1", "--set", "fault.step=2",
                    "--set", "fault.layout=2,1,1", timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "parity FAILED: layout 2,1,1 at step 2: loss" in run.stdout
