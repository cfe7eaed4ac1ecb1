"""Prepared data is recognised by its index: a directory holding anything `data prepare` writes but no
index.json is refused in one line (never read as raw bytes), and `data prepare` writes into a hidden
sibling renamed to --out only when complete, so a failed preparation leaves nothing at --out."""

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.data_helpers import PY_GLOB, prepare, train_tokenizer
from threefold.cli import main
from threefold.data.sources import load_tokens
from threefold.errors import UserError

TRAIN = ["train", "--model", "tiny", "--steps", "3", "--seq-len", "16", "--global-batch", "2", "--no-progress"]
# every document to train (the split hashes each document's path, which pytest's tmp directory changes), one worker
ONE_WORKER = ("--val-fraction", "0", "--workers", "1")
SMALL_SHARDS = (*ONE_WORKER, "--shard-mb", "0.0001")  # and shards of ~100 bytes


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("threefold: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A finished preparation with a BPE tokenizer (so its tokenizer/ copy is there too)."""
    root = tmp_path_factory.mktemp("marker")
    tok = train_tokenizer(root / "tok", vocab=300)
    assert prepare(root / "data", PY_GLOB, tokenizer=str(tok), extra=("--workers", "1", "--val-fraction", "0.2")) == 0
    return root / "data"


def test_a_prepared_directory_without_its_index_is_refused_naming_it(prepared, tmp_path, capsys):
    broken = tmp_path / "x"
    shutil.copytree(prepared, broken)
    (broken / "index.json").unlink()
    for args in (["--data", str(broken)], ["--set", f"data.sources={broken}:1"]):
        assert main(TRAIN + ["--out", str(tmp_path / "run"), *args]) == 2
        line = _one_error_line(capsys)
        assert f"'{broken}'" in line and "re-run `threefold data prepare`" in line, line
        assert line.startswith("threefold: error: data.source" + ("s:" if "--set" in args else ":")), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_every_entry_data_prepare_writes_marks_an_unfinished_preparation(prepared, tmp_path):
    """Each entry of a real preparation (walked here, not taken from threefold's list), beside plain text and
    without index.json, makes the directory refused as data; plain text alone is read byte by byte."""
    entries = sorted(p.relative_to(prepared) for p in prepared.rglob("*") if p.is_file())
    assert any(e.parts[0] == "tokenizer" for e in entries) and Path("plan.json") in entries
    tops = {e.parts[0] for e in entries} - {"index.json"}
    assert tops == {"plan.json", "parts", "shards", "tokenizer"}, tops
    for top in sorted(tops):
        raw = tmp_path / f"raw-{top}"
        raw.mkdir()
        (raw / "a.txt").write_text("plain text " * 10)
        source = prepared / top
        shutil.copytree(source, raw / top) if source.is_dir() else shutil.copyfile(source, raw / top)
        unfinished = f"data.source: '{raw}' holds an unfinished `threefold data prepare`"
        with pytest.raises(UserError, match=re.escape(unfinished)):
            load_tokens(str(raw), 256)
        # and one level down: a directory of text that holds such a directory is refused too
        with pytest.raises(UserError, match=re.escape(f"holds the output of `threefold data prepare` in '{raw}'")):
            load_tokens(str(tmp_path), 256)
        shutil.rmtree(raw)
    (tmp_path / "a.txt").write_text("héllo")
    assert load_tokens(str(tmp_path), 256).tolist() == list("héllo".encode())  # reference: the UTF-8 bytes
    with pytest.raises(UserError, match="is a prepared data directory; it is read through its index"):
        load_tokens(str(prepared), 300)


def test_a_failed_prepare_leaves_nothing_at_out_and_an_empty_out_is_filled(tmp_path, capsys):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("fine text " * 50)
    bad.write_bytes("ok\ncafé".encode("latin-1"))
    out = tmp_path / "data"
    # two tasks: the good file's is committed, the bad one's fails
    assert prepare(out, str(good), str(bad), extra=SMALL_SHARDS) == 2
    assert "b.txt" in _one_error_line(capsys)
    work = tmp_path / ".data.preparing"
    assert not out.exists() and sorted(p.name for p in (work / "parts").iterdir()) == ["00000.json"]
    assert main(TRAIN + ["--out", str(tmp_path / "run"), "--data", str(work)]) == 2
    assert "re-run `threefold data prepare`" in _one_error_line(capsys)
    # fixed in place (same size, same plan): the rerun keeps the committed task and finishes
    bad.write_bytes(b"ok\ncafe")
    out.mkdir()  # an empty --out is taken as well
    assert prepare(out, str(good), str(bad), extra=SMALL_SHARDS) == 0
    assert not work.exists() and (out / "index.json").is_file()
    assert sorted(os.listdir(out / "shards")) == ["train-00000.bin", "train-00001.bin"]
    assert (out / "shards" / "train-00001.bin").read_bytes()[:14] == b"o\0k\0\n\0c\0a\0f\0e\0"  # uint16 ids


def test_an_unfinished_directory_of_an_earlier_version_is_finished_not_lost(prepared, tmp_path, capsys):
    """--out holding a preparation made in place (no index) is moved to the sibling, finished, moved back."""
    text = tmp_path / "t.txt"
    text.write_text("some words " * 40)
    whole, partial = tmp_path / "whole", tmp_path / "partial"
    assert prepare(whole, str(text), extra=ONE_WORKER) == 0
    shutil.copytree(whole, partial)
    (partial / "index.json").unlink()
    (partial / "notes.md").write_text("mine")  # a user's file there goes where the directory goes
    assert prepare(partial, str(text), extra=ONE_WORKER) == 0
    assert (partial / "index.json").read_bytes() == (whole / "index.json").read_bytes()
    assert (partial / "notes.md").read_text() == "mine" and not (tmp_path / ".partial.preparing").exists()
