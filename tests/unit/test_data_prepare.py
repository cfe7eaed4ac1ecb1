"""`threefold data tokenizer train` and `threefold data prepare`: shards against an independent
tokenization, interruption, and every bad input (exit 2, one line naming the file)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.data_helpers import PY_GLOB, prepare, rows, train_tokenizer, write_hf_dataset, write_jsonl, write_parquet
from threefold.cli import main
from threefold.data.prepare import KILL_AFTER_ENV
from threefold.data.prepared import open_split
from threefold.data.tokenizer import check_tokenizer_match, load_tokenizer
from threefold.errors import UserError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _documents(directory: Path, split: str) -> list[list[int]]:
    index = json.loads((directory / "index.json").read_text())
    dtype = np.dtype(index["dtype"])
    docs = []
    for shard in index["splits"][split]["shards"]:
        tokens = np.fromfile(directory / shard["file"], dtype=dtype).tolist()
        begin = 0
        for end in shard["documents"]:
            docs.append(tokens[begin:end])
            begin = end
    return docs


def test_bpe_tokenizer_and_mixed_sources(tmp_path):
    tok_dir = train_tokenizer(tmp_path / "tok")
    texts = rows()
    sources = [PY_GLOB, str(write_jsonl(tmp_path / "a.jsonl", texts)),
               str(write_parquet(tmp_path / "b.parquet", texts)) + ":body",
               str(write_hf_dataset(tmp_path / "hf", texts))]
    assert prepare(tmp_path / "data", *sources, tokenizer=str(tok_dir), extra=("--val-fraction", "0.2", "--workers", "1")) == 0
    index = json.loads((tmp_path / "data" / "index.json").read_text())
    # reference: the tokenizers library itself, each document followed by the end-of-text id
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eot = ref.token_to_id("<|endoftext|>")
    assert index["tokenizer"]["vocab_size"] == ref.get_vocab_size() == 400
    assert index["tokenizer"]["eot_id"] == eot
    py_files = sorted(Path(PY_GLOB).parent.glob("*.py"))
    expected = [ref.encode(p.read_text(), add_special_tokens=False).ids + [eot] for p in py_files]
    expected += [ref.encode(t, add_special_tokens=False).ids + [eot] for t in texts * 3]
    got = _documents(tmp_path / "data", "train") + _documents(tmp_path / "data", "val")
    assert sorted(map(tuple, got)) == sorted(map(tuple, expected))
    val = index["splits"]["val"]["documents"]
    assert 0.1 * len(expected) < val < 0.3 * len(expected)
    assert index["splits"]["train"]["documents"] + val == len(expected)
    # the run's reader sees the same documents and the directory's own tokenizer copy
    docs = open_split(tmp_path / "data", "train", vocab=400)
    assert docs.tokens == index["splits"]["train"]["tokens"]
    assert load_tokenizer(tmp_path / "data" / "tokenizer").identity.sha256 == docs.tokenizer.sha256
    with pytest.raises(UserError, match=r"tokenized by the hf tokenizer 'tok'.*model uses the byte tokenizer"):
        check_tokenizer_match(docs.tokenizer, load_tokenizer("byte").identity, tmp_path / "data")


def _shard_bytes(directory: Path) -> dict:
    names = sorted(p.name for p in (directory / "shards").iterdir())
    return {n: (directory / "shards" / n).read_bytes() for n in names} | {
        "index.json": (directory / "index.json").read_bytes()}


def test_killed_prepare_resumes_to_identical_shards(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    for i, text in enumerate(rows(40)):
        (files / f"{i:03d}.txt").write_text(text * 40)
    args = ["data", "prepare", str(files), "--out", str(tmp_path / "whole"), "--workers", "1",
            "--shard-mb", "0.001", "--val-fraction", "0.25", "--no-progress"]
    assert main(args) == 0
    broken = [a if a != str(tmp_path / "whole") else str(tmp_path / "broken") for a in args]
    # killed by the preparation itself once 3 tasks are committed (its test hook), not by a poll
    # racing it: on a busy machine the child could finish all 40 before a poll saw 3
    env = dict(os.environ, PYTHONPATH=SRC, **{KILL_AFTER_ENV: "3"})
    child = subprocess.run([sys.executable, "-m", "threefold", *broken], env=env, stderr=subprocess.DEVNULL,
                           timeout=300)
    assert child.returncode == -signal.SIGKILL
    # killed, it left its work in the hidden sibling and nothing at --out (tests/unit/test_prepared_marker.py)
    committed = len(list((tmp_path / ".broken.preparing" / "parts").glob("*.json")))
    assert not (tmp_path / "broken").exists() and committed == 3, committed
    assert main(broken) == 0
    assert not (tmp_path / ".broken.preparing").exists()
    assert _shard_bytes(tmp_path / "broken") == _shard_bytes(tmp_path / "whole")


def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_bad_inputs_exit_2_naming_the_file(tmp_path, capsys):
    outs = iter(range(100))

    def base():
        return ["data", "prepare", "--out", str(tmp_path / f"out{next(outs)}"), "--no-progress", "--workers", "1"]

    _fails(capsys, base() + [str(tmp_path / "missing.txt")], "missing.txt", "does not exist")
    (tmp_path / "empty.txt").write_text("")
    _fails(capsys, base() + [str(tmp_path / "empty.txt")], "empty.txt", "gave no training tokens")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok line\ncafé".encode("latin-1"))
    _fails(capsys, base() + [str(bad)], "latin1.txt", "byte offset 11")
    jsonl = write_jsonl(tmp_path / "a.jsonl", ["x"] * 3, field="content")
    _fails(capsys, base() + [str(jsonl)], "a.jsonl", "line 1 has no field 'text'")
    parquet = write_parquet(tmp_path / "b.parquet", ["x"] * 3, column="body")
    _fails(capsys, base() + [f"{parquet}:text"], "b.parquet", "no column 'text'")
    # skipping instead: the bad file is counted, the good one prepared
    good = tmp_path / "good.txt"
    good.write_text("fine text " * 10)
    config = tmp_path / "skip.toml"
    config.write_text("[data]\nskip_bad_documents = true\n")
    argv = base() + [str(good), str(bad), "--config", str(config), "--val-fraction", "0"]
    assert main(argv) == 0
    assert json.loads((Path(argv[3]) / "index.json").read_text())["skipped_documents"] == 1
    capsys.readouterr()
    # a directory that is not ours is never overwritten; another preparation into ours is refused
    _fails(capsys, argv[:2] + [str(good), "--out", str(tmp_path), "--no-progress"], "is not a data directory")
    _fails(capsys, argv[:-6] + [str(good)], "holds the preparation of other sources")


def test_data_directory_checks(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("fine text " * 100)
    assert prepare(tmp_path / "d", str(good), extra=("--val-fraction", "0")) == 0
    open_split(tmp_path / "d", "train", vocab=257)
    with pytest.raises(UserError, match=r"shard '.*train-00000.bin' holds token id 256, beyond the model's vocab"):
        open_split(tmp_path / "d", "train", vocab=200)
    with pytest.raises(UserError, match="has no val documents"):
        open_split(tmp_path / "d", "val", vocab=257)
    shard = tmp_path / "d" / "shards" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match=r"shard '.*train-00000.bin' holds 1000 tokens but .*index.json says 1001"):
        open_split(tmp_path / "d", "train", vocab=257)


def test_hf_model_refuses_data_of_another_tokenizer(tmp_path):
    """`--model hf:DIR` with DIR's own tokenizer.json: data prepared by another tokenizer is refused in
    one line naming both; data of the model's tokenizer trains with the vocabulary of config.json."""
    import shutil

    from tests.hf_tasks import save_tiny
    from threefold.config import load_config
    from threefold.errors import ConfigError

    ours = train_tokenizer(tmp_path / "ours", vocab=300)
    other = train_tokenizer(tmp_path / "other", vocab=280)
    model = save_tiny("llama", tmp_path / "llama", vocab_size=320)
    shutil.copy(ours / "tokenizer.json", model / "tokenizer.json")
    shutil.copy(ours / "tokenizer_config.json", model / "tokenizer_config.json")
    assert prepare(tmp_path / "d_ours", PY_GLOB, tokenizer=str(ours)) == 0
    assert prepare(tmp_path / "d_other", PY_GLOB, tokenizer=str(other)) == 0

    def config(data):
        return load_config(None, [f"model.preset=hf:{model}", f"data.source={data}", "train.seq_len=16",
                                  "train.global_batch=2"]).validate(1)

    with pytest.raises(ConfigError) as refused:
        config(tmp_path / "d_other")
    message = str(refused.value)
    assert "\n" not in message and "'other'" in message and "'llama'" in message and "d_other" in message
    assert config(tmp_path / "d_ours").model.vocab == 320


def test_tokenizers_are_compared_by_what_they_do(tmp_path):
    """A tokenizer saved again through transformers' PreTrainedTokenizerFast (a new post-processor,
    another file hash) is the same tokenizer; one with a changed normaliser, or another vocabulary, is
    refused naming that part first."""
    import json

    transformers = pytest.importorskip("transformers")
    ours = train_tokenizer(tmp_path / "ours", vocab=300)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ours / "tokenizer.json"), eos_token="<|endoftext|>")
    fast.save_pretrained(str(tmp_path / "resaved"))
    original, resaved = load_tokenizer(ours).identity, load_tokenizer(tmp_path / "resaved").identity
    assert original.sha256 != resaved.sha256  # the file changed ...
    check_tokenizer_match(original, resaved, tmp_path / "data")  # ... the tokenizer did not
    edited = json.loads((ours / "tokenizer.json").read_text())
    edited["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "lower").mkdir()
    (tmp_path / "lower" / "tokenizer.json").write_text(json.dumps(edited))
    (tmp_path / "lower" / "tokenizer_config.json").write_text((ours / "tokenizer_config.json").read_text())
    with pytest.raises(UserError, match="whose normalizer differs"):
        check_tokenizer_match(original, load_tokenizer(tmp_path / "lower").identity, tmp_path / "data")
    other = load_tokenizer(train_tokenizer(tmp_path / "other", vocab=280)).identity
    with pytest.raises(UserError, match="whose vocabulary differs"):
        check_tokenizer_match(original, other, tmp_path / "data")
