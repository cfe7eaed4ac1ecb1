"""The command line answers without importing torch where a command does not need it."""

import subprocess
import sys
from pathlib import Path

from threefold.config import load_config
from threefold.train.inputs import warnings_for

SRC = str(Path(__file__).resolve().parents[2] / "src")
PROBE = """
import contextlib, io, sys
from threefold.cli import main
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
"""


def modules_after(*argvs: list[str]) -> str:
    run = subprocess.run([sys.executable, "-c", PROBE.format(argvs=list(argvs))], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC}, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_help_plan_and_schedule_start_without_torch(tmp_path):
    picture = str(tmp_path / "s.svg")
    assert modules_after(["--help"], ["train", "--help"], ["plan", "--help"], ["schedule", "--help"]) == "[]"
    # planning may use numpy for its stage balancing, never torch
    assert "torch" not in modules_after(["plan", "--model", "llama-7b", "--gpus", "8"])
    # drawing the picture needs matplotlib (and so numpy), never torch
    assert modules_after(["schedule", "--pp", "2", "--microbatches", "4", "--out", picture]) == "['numpy']"
    assert Path(picture).stat().st_size > 0


def test_train_help_names_choices_and_defaults(capsys):
    from threefold.cli import main

    try:
        main(["train", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "sets precision.compute; one of auto, fp32, bf16, fp16, fp8, mxfp8; default auto" in text
    assert "sets model.preset; one of tiny," in text and "sets train.steps; at least 0 (0: save the initial model and exit); default 20" in text
    assert "--overwrite" in text and "--verbose" in text


def test_dgc_with_adamw_warns_once_naming_the_setting():
    (warning,) = warnings_for(load_config(None, ["compress.method=dgc"]))
    assert "compress.dgc_momentum_correction" in warning and "train.optimizer=sgd" in warning
    assert warnings_for(load_config(None, ["compress.method=dgc", "train.optimizer=sgd", "train.lr=0.3"])) == []
    assert warnings_for(load_config(None, ["compress.method=dgc", "compress.dgc_momentum_correction=false"])) == []


def test_dualpipev_names_what_keeps_its_pairs_sequential():
    """dualpipev with ep > 1 hides each pair's all-to-alls behind the other side; a setting that keeps
    the pairs sequential (pipeline/split.py `overlaps_pairs`) is named in one warning, not silently on."""
    base = ["model.preset=tiny-moe", "parallel.pp=2", "pipeline.schedule=dualpipev", "parallel.dp=2",
            "parallel.ep=2", "train.microbatches=4"]
    assert not [w for w in warnings_for(load_config(None, base)) if "dualpipev" in w]
    for extra, named in ((["parallel.tp=2"], "parallel.tp=2"), (["parallel.zero=3"], "parallel.zero=3"),
                         (["remat.policy=full"], "remat.policy=full"), (["train.compile=true"], "train.compile=true")):
        (line,) = [w for w in warnings_for(load_config(None, base + extra)) if "dualpipev" in w]
        assert named in line and "not hidden" in line, line
    assert not [w for w in warnings_for(load_config(None, base[:-2] + ["parallel.tp=2"])) if "dualpipev" in w]
