"""Reading a prepared data directory: the index, checked against its shards, and memory maps.

Only numpy and json: the config checks read the index too (the model's vocabulary comes from
the directory's tokenizer), without importing torch.

Every shard's SHA-256 is compared with the index once per run, on a background thread
(`ShardCheck`, started when the split is opened): reading a shard's tokens waits until that
shard is confirmed, and once any shard is found changed, no further tokens are handed out.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from .tokenizer import TokenizerIdentity

INDEX = "index.json"
# what `data prepare` writes before its index (data/prepare.py): found without index.json, a preparation
# that did not finish (or whose index was removed), never raw text
PREPARE_WRITES = ("plan.json", "plan.json.tmp", "index.json.tmp", "parts", "shards", "tokenizer/tokenizer.json")


def is_prepared(path: str | Path, key: str = "data.source") -> bool:
    """Whether `path` is a directory `threefold data prepare` finished: its index.json is the marker.

    A directory holding what `data prepare` writes (PREPARE_WRITES) but no index.json raises UserError
    naming `key`, the directory and the fix: read as raw text it would train on its shards' bytes.
    """
    path = Path(path)
    if (path / INDEX).is_file():
        return True
    found = unfinished_preparation(path)
    if found:
        raise UserError(f"{key}: '{path}' holds an unfinished `threefold data prepare` ({', '.join(found)} but no "
                        f"{INDEX}: the preparation was killed or failed, or its index was removed), not data to "
                        f"train on; re-run `threefold data prepare` with its sources and --out {path}")
    return False


def unfinished_preparation(path: str | Path) -> list[str]:
    """What of `data prepare`'s output (PREPARE_WRITES) directory `path` holds; [] when none or no directory."""
    path = Path(path)
    if not path.is_dir():
        return []
    return [name for name in PREPARE_WRITES if (path / name).exists()]


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
        TokenizerIdentity.from_dict(index["tokenizer"])
        index["splits"]["train"]["shards"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"data: '{path}' is not a readable index of `threefold data prepare` ({e}); "
                        "prepare the directory again") from None
    return index


def tokenizer_of(directory: str | Path) -> TokenizerIdentity:
    return TokenizerIdentity.from_dict(read_index(directory)["tokenizer"])


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class ShardCheck:
    """The SHA-256 of every shard of a split, computed on a background thread and compared with the
    index; `confirm(k)` waits until shard k is confirmed and raises the first mismatch found."""

    def __init__(self, index: Path, shards: list[tuple[Path, str]]):
        self.index, self.shards = index, shards
        self._done = [threading.Event() for _ in shards]
        self._confirmed = [False] * len(shards)
        self._error: str | None = None
        threading.Thread(target=self._run, name="threefold-shard-check", daemon=True).start()

    def _run(self) -> None:
        try:
            for k, (path, expected) in enumerate(self.shards):
                try:
                    problem = None if sha256_of(path) == expected else (
                        f"does not match the sha256 that {self.index} lists for it (it changed after "
                        "`threefold data prepare` wrote it)")
                except OSError as e:
                    problem = f"cannot be read ({e.strerror or e})"
                if problem is not None and self._error is None:
                    self._error = f"data: shard '{path}' {problem}; prepare the directory again"
                self._done[k].set()
        finally:  # nothing waits forever, whatever happened here
            if not all(done.is_set() for done in self._done) and self._error is None:
                self._error = f"data: the shards of {self.index} could not be checked; prepare the directory again"
            for done in self._done:
                done.set()

    def confirm(self, shard: int) -> None:
        if not self._confirmed[shard]:
            self._done[shard].wait()
            self._confirmed[shard] = self._error is None
        if self._error is not None:
            raise UserError(self._error)


@dataclass
class Documents:
    """The documents of one split: lengths, and where each lies (shard, first token)."""

    directory: Path
    shards: list[np.ndarray]  # memory maps
    lengths: np.ndarray  # int64 per document
    shard_of: np.ndarray  # int32 per document
    start: np.ndarray  # int64 per document, offset in its shard
    tokenizer: TokenizerIdentity
    check: ShardCheck | None = None  # the shards' hashes, confirmed in the background

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def tokens_of(self, doc: int, first: int, count: int) -> np.ndarray:
        s, shard = int(self.start[doc]) + first, int(self.shard_of[doc])
        if self.check is not None:
            self.check.confirm(shard)  # no token of a shard whose hash is not confirmed
        return self.shards[shard][s: s + count]


def open_split(directory: str | Path, split: str, vocab: int) -> Documents:
    """The documents of `split`, after checking every shard against the index and the model's vocabulary."""
    directory = Path(directory)
    index = read_index(directory)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    shards, lengths, shard_of, starts, hashes = [], [], [], [], []
    for number, entry in enumerate(index["splits"].get(split, {}).get("shards", [])):
        path = directory / entry["file"]
        if not path.is_file():
            raise UserError(f"data: shard '{path}' listed in {directory / INDEX} is missing; prepare the directory again")
        size = path.stat().st_size
        if size != entry["tokens"] * dtype.itemsize:
            raise UserError(f"data: shard '{path}' holds {size // dtype.itemsize} tokens but {directory / INDEX} "
                            f"says {entry['tokens']}; the index does not match its shards, prepare the directory again")
        ends = np.asarray(entry["documents"], dtype=np.int64)
        if ends.size == 0 or ends[-1] != entry["tokens"] or np.any(np.diff(ends) <= 0):
            raise UserError(f"data: the document boundaries of shard '{path}' in {directory / INDEX} do not match "
                            "its tokens; prepare the directory again")
        if entry["max_token"] >= vocab:
            raise UserError(f"data: shard '{path}' holds token id {entry['max_token']}, beyond the model's "
                            f"vocabulary of {vocab}; use a model with the data's tokenizer (vocab "
                            f"{index['tokenizer']['vocab_size']})")
        if not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64:
            raise UserError(f"data: {directory / INDEX} lists no sha256 for shard '{path}'; prepare the directory "
                            "again")
        hashes.append((path, entry["sha256"]))
        shards.append(np.memmap(path, dtype=dtype, mode="r"))
        begin = np.concatenate([[0], ends[:-1]])
        lengths.append(ends - begin)
        starts.append(begin)
        shard_of.append(np.full(ends.size, number, dtype=np.int32))
    if not shards:
        raise UserError(f"data: '{directory}' has no {split} documents; prepare it with a larger --val-fraction"
                        if split == "val" else f"data: '{directory}' has no training documents")
    return Documents(directory, shards, np.concatenate(lengths), np.concatenate(shard_of), np.concatenate(starts),
                     TokenizerIdentity.from_dict(index["tokenizer"]), ShardCheck(directory / INDEX, hashes))


def mixture_of(text: str) -> list[tuple[str, float]]:
    """`data.sources` "DIR:WEIGHT,DIR:WEIGHT,..." (a missing weight is 1) -> [(DIR, WEIGHT), ...]."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        path, sep, weight = item.rpartition(":")
        if not sep:
            path, weight = item, "1"
        try:
            value = float(weight)
        except ValueError:
            raise UserError(f"data.sources: weight '{weight}' of '{item}' is not a number; write DIR:WEIGHT, "
                            "e.g. code:0.7,prose:0.3") from None
        if not value > 0:
            raise UserError(f"data.sources: weight of '{path}' must be positive, got {weight}")
        if not is_prepared(path, "data.sources"):
            raise UserError(f"data.sources: '{path}' is not a prepared data directory (no {INDEX}); "
                            "make it with `threefold data prepare`")
        out.append((path, value))
    return out


def data_tokenizer(source: str, sources: str) -> TokenizerIdentity | None:
    """The tokenizer of the prepared data a run reads (all mixture sources must share it), or None."""
    paths = [p for p, _ in mixture_of(sources)] if sources else [source] if is_prepared(source) else []
    identities = [(p, tokenizer_of(p)) for p in paths]
    for path, identity in identities[1:]:
        differs = identity.first_difference(identities[0][1])
        if differs is not None:
            raise UserError(f"data.sources: '{path}' was tokenized by the {identity.describe()}, but "
                            f"'{identities[0][0]}' by the {identities[0][1].describe()} (their {differs} differs); "
                            "prepare every source with one tokenizer")
    return identities[0][1] if identities else None
