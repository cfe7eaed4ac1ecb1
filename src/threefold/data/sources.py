"""Where tokens come from: synthetic, Python's standard library sources, or a user path.

Text is tokenized at the byte level (vocabulary 256): no tokenizer files, nothing to
download, and the same ids on every machine.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .prepared import is_prepared, unfinished_preparation

SYNTHETIC_TOKENS = 1 << 20
SYNTHETIC_SYMBOLS = 8  # ids the synthetic stream uses
SYNTHETIC_JUMP = 10  # one token in this many starts anywhere in the cycle
STDLIB_LIMIT_BYTES = 16 << 20  # plenty for the demo, and loads in well under a second
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def encode_bytes(text: str) -> torch.Tensor:
    """Byte-level tokenization: one token per UTF-8 byte."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode_bytes(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def load_tokens(source: str, vocab: int, seed: int = 0) -> torch.Tensor:
    """A 1-D tensor of token ids for `source` (synthetic | stdlib | path)."""
    if source == "synthetic":
        tokens = _synthetic(vocab, seed).clone()  # the cached stream stays as made
    elif source == "stdlib":
        tokens = _text_files(_stdlib_files(), STDLIB_LIMIT_BYTES)
    else:
        tokens = _from_path(Path(source))
    if tokens.numel() < 2:
        raise UserError(f"data.source: '{source}' holds fewer than 2 tokens; give more text")
    top = int(tokens.max())
    if top >= vocab:
        raise UserError(f"data.source: token id {top} does not fit model.vocab={vocab}; raise model.vocab")
    return tokens


@functools.lru_cache(maxsize=2)  # one process building several runs (a world's tests, a sweep) makes it once
def _synthetic(vocab: int, seed: int) -> torch.Tensor:
    """Tokens that walk a fixed cycle of SYNTHETIC_SYMBOLS ids and jump to a random place of it
    one time in SYNTHETIC_JUMP: a rule strong enough that a model learns it visibly in a few
    steps (the best achievable loss is about 0.5 nats)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(vocab, SYNTHETIC_SYMBOLS)
    cycle = torch.randperm(vocab, generator=gen)[:k]
    jumps = torch.rand(SYNTHETIC_TOKENS, generator=gen) < 1 / SYNTHETIC_JUMP
    jumps[0] = True
    landing = torch.randint(0, k, (SYNTHETIC_TOKENS,), generator=gen)
    index = torch.arange(SYNTHETIC_TOKENS)
    last_jump = torch.cummax(torch.where(jumps, index, 0), 0).values
    return cycle[(landing[last_jump] + index - last_jump) % k]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        found.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    return found


def _refuse_prepared(path: Path) -> None:
    """A directory of `data prepare` is never read as raw bytes: finished, it is read through its index
    (data/build.py); unfinished, `is_prepared` refuses it."""
    if is_prepared(path):
        raise UserError(f"data.source: '{path}' is a prepared data directory; it is read through its index "
                        "(threefold.data.build_samplers), not as raw bytes")


def _text_files(paths: list[Path], limit: int | None = None) -> torch.Tensor:
    chunks, size = [], 0
    for path in paths:
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if limit is not None and size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def _from_path(path: Path) -> torch.Tensor:
    if path.is_dir():
        _refuse_prepared(path)
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UserError(f"data.source: directory '{path}' holds no files")
        inner = sorted(d for d in {f.parent for f in files} - {path} if unfinished_preparation(d))
        if inner:
            raise UserError(f"data.source: '{path}' holds the output of `threefold data prepare` in '{inner[0]}', "
                            "whose shards would be read as text bytes; pass that directory itself as --data")
        return _text_files(files)
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)  # never unpickle user data
        except ValueError as e:
            raise UserError(f"data.source: '{path}' is not a plain numeric .npy array ({e})") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise UserError(f"data.source: '{path}' must be a 1-D integer token array, got {array.dtype} {array.shape}")
        return torch.from_numpy(array.astype(np.int64))
    return _text_files([path])
