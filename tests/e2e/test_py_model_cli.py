"""`threefold train --model py:MODULE:FACTORY`: a user's own nn.Module (tests/engine_models.py's TinyLM)
trained by the command line under ZeRO-3 with activation checkpointing on 2 processes, its losses those of
the user's plain loop over the same batches; `--tp 2` without a plan is refused in one line (in process: it
exits before any process starts)."""

import json
import re

from tests.e2e.cli import threefold
from threefold.cli import main

MODEL = "py:tests.engine_models:tiny_lm"


def test_py_model_trains_under_zero3_and_remat(tmp_path):
    run = threefold("train", "--model", MODEL, "--set", "model.vocab=64", "--nproc", "2", "--zero", "3",
                    "--activation-checkpointing", "full", "--steps", "4", "--seq-len", "16", "--global-batch", "4",
                    "--lr", "3e-3", "--out", str(tmp_path / "run"), "--no-progress", "--save-every", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    want = plain_loop(steps=4, seq_len=16, global_batch=4, lr=3e-3)
    assert len(losses) == 4 and all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, want)), (losses, want)
    assert rows[-1]["comm"]["dp"]["all_gather"] > 0 and rows[-1]["comm"]["dp"]["reduce_scatter"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-00000004").is_dir()


def plain_loop(steps: int, seq_len: int, global_batch: int, lr: float) -> list[float]:
    """The user's loop over the same batches (threefold's synthetic sampler): AdamW on matrices with decay,
    clipping at 1, the cosine schedule; the module from its factory under the run's seed."""
    import torch
    import torch.nn.functional as F

    from tests.engine_models import tiny_lm
    from threefold.config import load_config
    from threefold.data.build import build_samplers
    from threefold.train.optim import lr_at

    cfg = load_config(None, [f"model.preset={MODEL}", "model.vocab=64", f"train.steps={steps}", f"train.lr={lr}",
                             f"train.seq_len={seq_len}", f"train.global_batch={global_batch}"])
    sampler, _ = build_samplers(cfg.data, seq_len, global_batch, 0, 64)
    torch.manual_seed(0)
    model = tiny_lm()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    losses = []
    for step in range(1, steps + 1):
        batch = sampler.step_batch(step - 1)
        opt.zero_grad()
        loss = F.cross_entropy(model(batch.inputs).flatten(0, 1), batch.targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.train)
        opt.step()
        losses.append(loss.item())
    return losses


def test_tp_without_a_plan_is_refused_in_one_line(tmp_path, capsys):
    code = main(["train", "--model", MODEL, "--set", "model.vocab=64", "--tp", "2", "--nproc", "2",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tp" in err[0] and "plan" in err[0], err


EXITS = {"on_import": "import sys\nsys.exit(0)\n",
         "in_factory": "import sys\n\ndef build():\n    sys.exit(3)\n",
         "no_params": "from torch import nn\n\nclass M(nn.Module):\n    vocab_size = 64\n\n"
                      "    def forward(self, x):\n        return x\n\ndef build():\n    return M()\n",
         "frozen": "from torch import nn\n\nclass M(nn.Module):\n    vocab_size = 64\n\n    def __init__(self):\n"
                   "        super().__init__()\n        self.e = nn.Embedding(64, 64).requires_grad_(False)\n\n"
                   "    def forward(self, x):\n        return self.e(x)\n\ndef build():\n    return M()\n"}


def _user_module(tmp_path, monkeypatch, kind: str) -> str:
    """`py:` preset of a module file written for this test (its own name: a failed import is not cached)."""
    name = "user_" + kind + "_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"{name}.py").write_text(EXITS[kind])
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"py:{name}:build"


def test_a_module_that_exits_or_has_nothing_to_train_is_refused(tmp_path, monkeypatch):
    """sys.exit on import or in the factory (any code, 0 too) and a module without trainable parameters:
    a ConfigError naming model.preset and the module, never a silent exit or an empty run."""
    import pytest

    from threefold.config import load_config
    from threefold.errors import ConfigError
    from threefold.models.registry import model_spec

    want = {"on_import": "called sys.exit(0)", "in_factory": "() called sys.exit(3)",
            "no_params": "it has no parameters", "frozen": "its 1 parameters all have requires_grad=False"}
    for kind, says in want.items():
        preset = _user_module(tmp_path, monkeypatch, kind)
        cfg = load_config(None, [f"model.preset={preset}", "model.vocab=64"])
        with pytest.raises(ConfigError) as e:
            model_spec(cfg.model, 0).build()
        line = str(e.value)
        assert line.startswith("model.preset: ") and says in line and preset.split(":")[1] in line, line
        assert "\n" not in line


def test_train_of_a_module_that_exits_on_import_is_one_line_exit_2(tmp_path, monkeypatch, capsys, alone):
    preset = _user_module(tmp_path, monkeypatch, "on_import")
    code = main(["train", "--model", preset, "--set", "model.vocab=64", "--steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error" in line.lower() or "Traceback" in line]
    assert code == 2 and errors == err[-1:] and "model.preset: importing 'user_on_import" in err[-1], (code, err)
    assert "called sys.exit(0)" in err[-1]
