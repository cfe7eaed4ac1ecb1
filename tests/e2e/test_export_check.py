"""`threefold ckpt export --hf` prints its logit check; `--no-check` skips it; a wrong export (the rotary
row permutation dropped, in a child process that patches it before threefold's main) exits 2 with one
line naming the worst position and leaves no export behind."""

import pytest

from tests.e2e.cli import threefold

pytest.importorskip("transformers")

BROKEN = ("import sys\n"
          "from threefold.models import reference_hf\n"
          "reference_hf.rope_pairs_to_halves = lambda t, head_dim: t.clone()\n"
          "from threefold.cli import main\n"
          "sys.exit(main(sys.argv[1:]))\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("export-cli") / "run"
    trained = threefold("train", "--model", "tiny-llama", "--steps", "1", "--global-batch", "2", "--seq-len", "16",
                        "--save-every", "1", "--no-progress", "--out", str(out))
    assert trained.returncode == 0, trained.stderr[-3000:]
    return out


def test_export_prints_the_check_and_no_check_skips_it(run, tmp_path, capsys):
    """Through `main` in this process (the wrong export below needs a child of its own: it patches a module)."""
    from threefold.cli import main

    capsys.readouterr()
    rc = main(["ckpt", "export", str(run), "--hf", str(tmp_path / "hf")])
    export = capsys.readouterr()
    assert rc == 0, export.err[-3000:]
    lines = [line for line in export.out.splitlines() if line.startswith("export check:")]
    assert len(lines) == 1 and "logits match transformers, max relative error" in lines[0], export.out
    assert lines[0].endswith("over 4x16 tokens (bound 1e-05, float32)"), lines
    rc = main(["ckpt", "export", str(run), "--hf", str(tmp_path / "unchecked"), "--no-check"])
    skipped = capsys.readouterr()
    assert rc == 0 and "export check" not in skipped.out, skipped.out + skipped.err


def test_a_wrong_export_exits_2_naming_the_position_and_is_removed(run, tmp_path):
    out = tmp_path / "broken"
    broken = threefold("ckpt", "export", str(run), "--hf", str(out), script=BROKEN)
    assert broken.returncode == 2, broken.stderr[-3000:]
    lines = [line for line in broken.stderr.splitlines() if "export check" in line]
    assert len(lines) == 1 and "export check FAILED: logits differ from transformers at sequence " in lines[0]
    assert f"removed {out}" in lines[0] and not out.exists()
