"""Prepared data is what its index says: every shard's sha256 is confirmed (in the background)
before a batch reads it, and every step's token ids are bounded on the device."""

import threading

import numpy as np
import pytest
import torch

from tests.data_helpers import write_prepared
from tests.helpers import make_config
from tests.host_sync import HostSyncCounter
from threefold.config import DataConfig
from threefold.data import Batch, prepared
from threefold.data.build import build_samplers
from threefold.data.loader import Loader, bound_ids
from threefold.errors import UserError

SEQ = 16


def _data(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 250, size=int(rng.integers(20, 60))).tolist() for _ in range(40)]
    return write_prepared(tmp_path / "data", docs, vocab=257)


def _loader(directory, depth=0) -> Loader:
    sampler, _ = build_samplers(DataConfig(source=str(directory)), SEQ, 4, 0, 257)
    return Loader(sampler, 1, 0, 1, torch.device("cpu"), depth)


def _overwrite(shard, offset: int, count: int, value: int = 7) -> None:
    """Change `count` tokens of `shard` in place: same size, same document boundaries, other ids."""
    tokens = np.fromfile(shard, dtype="<u4")
    tokens[offset: offset + count] = value
    tokens.tofile(shard)


def test_a_changed_shard_stops_the_run_in_one_line(tmp_path):
    directory = _data(tmp_path)
    assert _loader(directory).get(0)[0][0].inputs.shape == (4, SEQ)  # intact: reads
    shard = directory / "shards" / "train-00001.bin"
    _overwrite(shard, 10, 200)
    for depth in (0, 2):  # in the step, and on the loader's thread
        loader = _loader(directory, depth)
        with pytest.raises(UserError) as err:
            for step in range(50):  # the first batch that reads either shard stops it
                loader.get(step)
        loader.close()
        text = str(err.value)
        assert f"shard '{shard}'" in text and "sha256" in text and "prepare the directory again" in text, text
        assert "\n" not in text


def test_no_batch_reads_a_shard_before_its_hash_is_confirmed(tmp_path, monkeypatch):
    directory = _data(tmp_path)
    release, asked = threading.Event(), []
    sha256_of = prepared.sha256_of

    def slow(path):
        asked.append(path.name)
        release.wait(60)
        return sha256_of(path)

    monkeypatch.setattr(prepared, "sha256_of", slow)
    loader = _loader(directory)
    got = []
    reader = threading.Thread(target=lambda: got.append(loader.get(0)), daemon=True)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got and asked == ["train-00000.bin"]  # waits for the check
    release.set()
    reader.join(60)
    assert got and got[0][0][0].inputs.shape == (4, SEQ)


def test_the_step_id_figure_is_computed_on_the_device_without_a_read():
    good = [Batch(torch.tensor([[1, 2]]), torch.tensor([[2, 3]])),
            Batch(torch.tensor([[5, 0]]), torch.tensor([[0, 4]]))]
    with HostSyncCounter() as counter:
        batches, figure = bound_ids(good, 10)
    assert counter.sites == [] and figure.dim() == 0 and int(figure) == 5
    assert all(torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) for a, b in zip(batches, good))
    bad = [Batch(torch.tensor([[1, 60000]]), torch.tensor([[60000, 3]])), good[1]]
    batches, figure = bound_ids(bad, 10)
    assert int(figure) == 60000 and batches[0].inputs.tolist() == [[1, 0]] and batches[0].targets.tolist() == [[0, 3]]
    batches, figure = bound_ids([Batch(torch.tensor([[1, -3]]), torch.tensor([[60000, 3]]))], 10)
    assert int(figure) == -3 and batches[0].inputs.tolist() == [[1, 0]]


@pytest.mark.parametrize("bad", [60000, 256, -1])
def test_a_token_id_outside_the_vocabulary_stops_the_step_naming_it(bad, tmp_path, alone):
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(["model.preset=tiny", "model.layers=1", "train.steps=3", "train.global_batch=2",
                                   "train.seq_len=16"], str(tmp_path / "run")))
    get = trainer.loader.get

    def poisoned(step):
        batches, wait = get(step)
        if step == 1:  # the second step
            batches[0].inputs[0, 3] = bad
        return batches, wait

    trainer.loader.get = poisoned
    try:
        trainer.train_one_step()
        with pytest.raises(UserError) as err:
            trainer.train_one_step()
    finally:
        trainer.loader.close()
    text = str(err.value)
    assert text.startswith("data: step 2 read token id") and f" {bad} " in text and "data.source 'synthetic'" in text
    assert "vocabulary of 256" in text, text


def test_training_on_a_changed_shard_exits_2_in_one_line(tmp_path, capsys, alone):
    from tests.data_helpers import PY_GLOB, prepare
    from threefold.cli import main

    assert prepare(tmp_path / "data", PY_GLOB) == 0
    (shard,) = (tmp_path / "data" / "shards").glob("train-*.bin")
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[100:2100] = 32  # 2000 spaces: size, boundaries and max_token as the index says
    tokens.tofile(shard)
    capsys.readouterr()
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "data"), "--steps", "2", "--global-batch", "2",
                 "--seq-len", "16", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("threefold: error: data: shard '"), errors
    assert str(shard) in errors[0] and "prepare the directory again" in errors[0]
