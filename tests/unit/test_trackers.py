"""run.trackers: W&B (offline) and MLflow (a file store) get what metrics.jsonl gets, read back through
each library's own format and compared exactly; a tracker that raises or hangs costs one line and
the run goes on; a tracker whose library is missing is refused before any work."""

import json
import struct
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from tests.helpers import make_config
from threefold.cli import main
from threefold.observe import trackers

BASE = ["model.preset=tiny", "model.layers=1", "train.global_batch=2", "train.seq_len=16", "train.steps=3"]


def _train(out, *overrides):
    from threefold.train.trainer import Trainer

    return Trainer(make_config(BASE + list(overrides), str(out))).run()


def _leaves(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a metrics.jsonl line, written here rather than taken from trackers.py."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}/"))
        elif isinstance(value, list):
            out.update(_leaves(dict(enumerate(value)), f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            out[f"{prefix}{key}"] = float(value)
    return out


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _wandb_records(path):
    """The records of a .wandb file: leveldb-log framing (a 7-byte file header, 32 KiB blocks, 7-byte
    chunk headers: crc, length, type) around wandb's own protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


@pytest.fixture
def stores(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    (tmp_path / "wandb").mkdir()
    return tmp_path


def test_wandb_and_mlflow_read_back_equal_metrics_jsonl(stores, alone, capsys):
    from mlflow.tracking import MlflowClient

    out = stores / "run"
    _train(out, "run.trackers=wandb, mlflow", "run.plot=true")
    assert "threefold: tracker" not in capsys.readouterr().err
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    want = {r["step"]: {k: v for k, v in _leaves(r).items() if k != "step"} for r in rows}
    assert {"loss", "grad_norm", "lr", "mem/peak", "skipped"} <= set(want[1])

    client = MlflowClient(f"file:{stores / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("threefold").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    got = {}
    for key in want[1]:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert got == want
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert run.data.params["train.steps"] == "3" and run.data.params["run.trackers"] == "wandb, mlflow"
    assert len(run.data.params) == sum(len(section) for section in resolved.values())
    assert json.loads((Path(client.download_artifacts(run.info.run_id, "config.json", str(stores))).read_text())) == resolved
    assert run.data.tags["summary.steps"] == "3" and run.data.tags["summary.line"].startswith("done: 3 steps")
    plots = sorted(f.path for f in client.list_artifacts(run.info.run_id, "plots"))
    assert plots == [f"plots/{p.name}" for p in sorted(out.glob("*.png"))] and plots

    (path,) = (stores / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    records = list(_wandb_records(path))
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = {h["_step"]: {k: v for k, v in h.items() if not k.startswith(("_", "plots/"))} for h in history}
    assert logged == want
    images = {k.split("/")[1]: v for h in history for k, v in h.items() if k.startswith("plots/") and k.endswith("/path")}
    assert sorted(images) == sorted(p.stem for p in out.glob("*.png")) and images
    for name, stored in images.items():  # the PNGs themselves, in the run's files
        assert (path.parent / "files" / stored).read_bytes() == (out / f"{name}.png").read_bytes()
    (config,) = [_items(r.run.config.update) for r in records if r.WhichOneof("record_type") == "run"]
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert {k: v for k, v in config.items() if not k.startswith("_")} == resolved
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["final_loss"] == rows[-1]["loss"] and summary["steps"] == 3


def _one_warning(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("threefold: tracker")]
    assert len(lines) == 1, err
    assert lines[0].endswith("(metrics.jsonl is complete)")
    return lines[0]


def test_a_tracker_that_raises_costs_one_line(stores, alone, monkeypatch, capsys):
    calls = []

    def broken(self, step, values):
        calls.append(step)
        raise ConnectionError("the server went away\nand said more")

    monkeypatch.setattr(trackers.MlflowTracker, "log", broken)
    _train(stores / "run", "run.trackers=mlflow")
    line = _one_warning(capsys.readouterr().err)
    assert line.startswith("threefold: tracker mlflow: log failed: ConnectionError: the server went away ("), line
    assert calls == [1]  # dropped after its first failure
    assert [r["step"] for r in _metrics(stores / "run")] == [1, 2, 3]


@pytest.mark.timeout(300)  # a step that waited for the tracker would wait for ever
def test_a_tracker_that_hangs_costs_one_line_and_holds_up_no_step(stores, alone, monkeypatch, capsys):
    release = threading.Event()
    monkeypatch.setattr(trackers.MlflowTracker, "log", lambda self, step, values: release.wait())
    monkeypatch.setattr(trackers, "CLOSE_WAIT_S", 0.5)
    try:
        _train(stores / "run", "run.trackers=mlflow")
    finally:
        release.set()  # let the thread left behind end
    line = _one_warning(capsys.readouterr().err)
    assert line == "threefold: tracker mlflow: did not finish within 0.5 s; left behind (metrics.jsonl is complete)"
    assert [r["step"] for r in _metrics(stores / "run")] == [1, 2, 3]


@pytest.mark.parametrize("key, package, pip", [("run.trackers=wandb", "wandb", "pip install wandb"),
                                               ("run.trackers=mlflow", "mlflow", "pip install mlflow-skinny"),
                                               ("run.tensorboard=true", "tensorboard", "pip install tensorboard")])
def test_a_tracker_not_installed_is_refused_before_any_work(tmp_path, monkeypatch, capsys, key, package, pip):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` fails as when it is not installed
    out = tmp_path / "run"
    assert main(["train", "--no-progress", "--out", str(out), *(f"--set={o}" for o in [*BASE, key])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].endswith(f"{key.split('=')[0]}: {package} needs the {package} package, which is not installed; "
                           f"{pip}"), err
    assert not (out / "metrics.jsonl").exists()
