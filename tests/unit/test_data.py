import numpy as np
import pytest
import torch

from threefold.data import Sampler, load_tokens
from threefold.data.sources import decode_bytes, encode_bytes
from threefold.errors import UserError


def test_global_batch_is_the_same_for_every_layout():
    tokens = load_tokens("synthetic", 256, seed=1)
    sampler = Sampler(tokens, seq_len=16, global_batch=8, seed=5)
    for step in (0, 3):
        whole = sampler.step_batch(step)
        for dp in (2, 4):
            parts = [sampler.step_batch(step, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        mbs = sampler.microbatches(step, 4)
        assert torch.equal(torch.cat([m.targets for m in mbs]), whole.targets)
    assert torch.equal(whole.inputs[:, 1:], whole.targets[:, :-1])
    assert not torch.equal(sampler.step_batch(1).inputs, sampler.step_batch(2).inputs)
    # resuming needs only the step: a fresh sampler gives the same batch
    again = Sampler(tokens, seq_len=16, global_batch=8, seed=5)
    assert torch.equal(again.step_batch(3).inputs, whole.inputs)


def test_stdlib_corpus_is_python_text():
    tokens = load_tokens("stdlib", 256)
    assert tokens.numel() > 1_000_000 and tokens.dtype == torch.uint8
    assert "def " in decode_bytes(tokens[:20000])


def test_user_paths(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.txt").write_text("héllo")
    assert decode_bytes(load_tokens(str(tmp_path), 256)) == "hello worldhéllo"
    assert torch.equal(load_tokens(str(tmp_path / "a.txt"), 256), encode_bytes("hello world"))
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    assert load_tokens(str(tmp_path / "t.npy"), 256).tolist() == list(range(10))
    np.save(tmp_path / "big.npy", np.array([5, 70000]))
    with pytest.raises(UserError, match="does not fit model.vocab"):
        load_tokens(str(tmp_path / "big.npy"), 256)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match="not a plain numeric"):
        load_tokens(str(tmp_path / "obj.npy"), 256)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no files"):
        load_tokens(str(empty), 256)
