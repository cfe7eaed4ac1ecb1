"""Training from a prepared directory (BPE tokenizer trained here; .py files, JSON Lines and Parquet):
validation loss falls on 2 processes (dp=2 and pp=2 agree), evaluation leaves training untouched, and a run saved on
dp=2 mid-epoch resumes on one process with the same losses (the token ids of every step under
other layouts are compared in tests/unit/test_data_epochs.py)."""

import json
import math

import pytest

from tests.data_helpers import PY_GLOB, prepare, rows, train_tokenizer, write_jsonl, write_parquet
from tests.helpers import train_and_report
from threefold.checkpoint.format import step_dir_name

# a constant learning rate (min_lr_ratio=1): runs of other lengths take the same steps
BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=32", "train.lr=3e-3", "train.eps=1e-6",
        "train.min_lr_ratio=1.0", "train.steps=8"]
EVAL = ["train.eval_every=4", "train.eval_batches=2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-data")
    tok = train_tokenizer(root / "tok", vocab=400)
    texts = rows()
    sources = [PY_GLOB, str(write_jsonl(root / "a.jsonl", texts)), f"{write_parquet(root / 'b.parquet', texts)}:body"]
    assert prepare(root / "data", *sources, tokenizer=str(tok), extra=("--val-fraction", "0.2", "--workers", "1")) == 0
    return root / "data"


def test_validation_falls_and_a_resume_under_another_layout_continues_exactly(worlds, data_dir, tmp_path):
    data = [f"data.source={data_dir}"]
    ref = worlds(2).run(train_and_report, BASE + EVAL + data + ["checkpoint.save_every=4"], str(tmp_path / "ref"))
    records = ref[0]["records"]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val) == [4, 8]
    assert val[8] < val[4] < math.log(400), val  # falling, and below a uniform guess over the vocabulary
    assert records[3]["val_ppl"] == pytest.approx(math.exp(val[4]))
    lines = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("val_loss") for x in lines] == [r.get("val_loss") for r in records]
    assert all(x["data_wait_s"] >= 0 for x in lines)
    ckpt = tmp_path / "ref" / "checkpoints" / step_dir_name(4)
    position = json.loads((ckpt / "manifest.json").read_text())["data"]["position"]
    assert position["epoch"] * position["sequences_per_epoch"] + position["position"] == 4 * 8
    # evaluation does not touch training: the same run without it has bitwise the same losses
    plain = worlds(2).run(train_and_report, BASE + data, str(tmp_path / "plain"))
    assert plain[0]["losses"] == ref[0]["losses"]
    # pipeline parallel: validation runs through the schedule and its gradients are discarded
    piped = worlds(2).run(train_and_report, BASE + EVAL + data + ["parallel.pp=2", "train.microbatches=2",
                                                                  "train.steps=5"], str(tmp_path / "pp"))[0]["records"]
    assert abs(piped[3]["val_loss"] - val[4]) <= 1e-5 * val[4]
    for r, expected in zip(piped, records):  # step 5 comes after an evaluation
        assert abs(r["loss"] - expected["loss"]) <= 1e-5 * expected["loss"], (r["step"], r["loss"], expected["loss"])
    # resume the dp=2 checkpoint of step 4 on one process: steps 5-8 and the step-8 validation loss continue
    resumed = worlds(1).run(train_and_report, BASE + EVAL + data + [f"checkpoint.resume={ckpt}"],
                            str(tmp_path / "resumed"))[0]["records"]
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for r, expected in zip(resumed, records[4:]):
        assert abs(r["loss"] - expected["loss"]) <= 1e-5 * expected["loss"], (r["step"], r["loss"], expected["loss"])
    assert abs(resumed[-1]["val_loss"] - val[8]) <= 1e-5 * val[8]
