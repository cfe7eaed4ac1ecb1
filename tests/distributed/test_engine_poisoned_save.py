"""`Engine.save` (the library API) never saves a step whose loss is not finite, as the trainer's
checkpointing does not: one line on rank 0 names the step, the rank whose own loss went non-finite
and the newest checkpoint, which stays the newest; save returns None; the next finite step saves. The NaN comes in through the
library API itself: rank 1's inputs of step 3."""

import contextlib
import io
from pathlib import Path

import torch
from torch import nn

from threefold.checkpoint.verify import verify
from threefold.checkpoint.writer import complete_checkpoints


def _batch(step: int, rank: int, nan_at: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    if step == nan_at and rank == 1:
        x[2, 3] = float("nan")
    return x, y


def save_each_step(ckpt: str, nan_at: int) -> dict:
    import threefold

    torch.manual_seed(0)
    engine = threefold.prepare(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), nn.MSELoss(),
                               ["train.steps=4", "train.lr=1e-2"])
    rank, _ = engine.batch_shard
    err, saved = io.StringIO(), []
    with contextlib.redirect_stderr(err):
        for step in range(1, 5):
            engine.train_step(_batch(step, rank, nan_at))
            saved.append(engine.save(ckpt))
    return {"stderr": err.getvalue(), "saved": [None if p is None else p.name for p in saved],
            "complete": [p.name for p in complete_checkpoints(Path(ckpt))]}


def test_engine_save_refuses_a_nan_step_naming_the_rank(worlds, tmp_path):
    ckpt = tmp_path / "ckpt"
    out = worlds(2).run(save_each_step, str(ckpt), 3)
    # step 3 is refused; its update was skipped (a non-finite gradient norm), so step 4 is finite and saves
    assert out[0]["saved"] == out[1]["saved"] == ["step-00000001", "step-00000002", None, "step-00000004"], out
    assert out[0]["complete"] == ["step-00000001", "step-00000002", "step-00000004"], out
    lines = [line for line in out[0]["stderr"].splitlines() if "not saved" in line]
    assert len(lines) == 1, out[0]["stderr"]
    assert lines[0].startswith("threefold: step 3 not saved: non-finite loss nan"), lines
    assert "(first on rank(s) 1 (loss))" in lines[0], lines
    assert lines[0].endswith(f"the newest checkpoint stays {ckpt / 'step-00000002'}"), lines
    assert "not saved" not in out[1]["stderr"]  # one line for the world, from rank 0
    manifest, problems = verify(ckpt / "step-00000002")
    assert not problems and manifest.step == 2

