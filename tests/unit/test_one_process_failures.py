"""A run of one process (no --nproc) reports a failure as a rank of --nproc does: one line with
the error, one naming the log that holds the traceback (OUT/logs/rank-0.log), exit code 1; no
traceback on the terminal unless --verbose. Each case: an injected fault, and a `py:` module
that raises on import, whose factory raises, whose parameters are on the meta device, whose
output has the wrong shape, or that is named relatively."""

import sys

import pytest

from threefold.cli import main

RUN = ["train", "--steps", "2", "--global-batch", "2", "--seq-len", "8", "--no-progress"]

MODULE = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, out=32, device=None):
        super().__init__()
        self.vocab_size = 32
        self.emb = nn.Embedding(32, 8, device=device)
        self.head = nn.Linear(8, out, device=device)

    def forward(self, x):
        return self.head(self.emb(x))


def good():
    return Model()


def broken():
    raise RuntimeError("the factory broke")


def on_meta():
    return Model(device="meta")


def wrong_shape():
    return Model(out=7)
'''

PY = ["--set", "model.vocab=32"]
CASES = {  # name: (options, the error's line)
    "fault": (["--model", "tiny", "--set", "model.layers=1", "--set", "fault.kind=raise", "--set", "fault.rank=0",
               "--set", "fault.step=1"], "RuntimeError: injected fault on rank 0 at step 1"),
    "import": (["--model", "py:tf_raises_on_import:good", *PY], "ValueError: this module does not import"),
    "factory": (["--model", "py:tf_models:broken", *PY], "RuntimeError: the factory broke"),
    "meta": (["--model", "py:tf_models:on_meta", *PY], "NotImplementedError: Cannot copy out of meta tensor"),
    "shape": (["--model", "py:tf_models:wrong_shape", *PY], "IndexError: Target "),
    "relative": (["--model", "py:..tf_models:good", *PY], "TypeError: the 'package' argument is required"),
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """The `py:` modules of the cases, importable from the working directory, forgotten after."""
    (tmp_path / "tf_models.py").write_text(MODULE)
    (tmp_path / "tf_raises_on_import.py").write_text('raise ValueError("this module does not import")\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("tf_models", "tf_raises_on_import"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("case", list(CASES))
def test_a_failure_of_one_process_is_two_lines_and_its_log(case, modules, capsys, alone):
    options, error = CASES[case]
    out = modules / "run"
    assert main([*RUN, *options, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and 'File "' not in err, err
    ours = [line for line in err.splitlines() if line.startswith("threefold:")]
    log = out / "logs" / "rank-0.log"
    assert len(ours) == 2, err
    assert ours[0].startswith(f"threefold: failed: {error}") and "\n" not in ours[0], err
    assert ours[1] == f"threefold: full log: {log} (--verbose shows the traceback here)", err
    text = log.read_text()
    assert text.startswith("==== rank 0 (one process), ") and "Traceback (most recent call last)" in text
    assert text.rstrip().splitlines()[-1].startswith(error), text  # the whole traceback, ending in the error


def test_verbose_shows_the_traceback_here_too(modules, capsys, alone):
    out = modules / "run"
    assert main([*RUN, *CASES["factory"][0], "--out", str(out), "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("the factory broke")' in err, err
    ours = [line for line in err.splitlines() if line.startswith("threefold:")]
    assert ours == ["threefold: failed: RuntimeError: the factory broke",
                    f"threefold: full log: {out / 'logs' / 'rank-0.log'}"], err
    assert "Traceback" in (out / "logs" / "rank-0.log").read_text()


def test_a_user_error_stays_one_line_and_exit_2(modules, capsys, alone):
    out = modules / "run"
    assert main([*RUN, "--model", "py:tf_models:missing", *PY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "threefold: error: model.preset: 'tf_models' has no callable 'missing'", err
    assert not (out / "logs").exists()
