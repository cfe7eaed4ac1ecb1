"""Small corpora for the data tests: stdlib Python files, a JSON Lines file, a Parquet file and a
`datasets` directory, written into a temporary directory (nothing is downloaded)."""

import hashlib
import json
import sysconfig
from pathlib import Path

from threefold.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PY_GLOB = str(STDLIB / "json" / "*.py")  # a handful of files, ~60 kB


def rows(n: int = 120) -> list[str]:
    return [f"def f{i}(x):\n    return x * {i}  # número {i}\n" for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_parquet(path: Path, texts: list[str], column: str = "body") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path)
    return path


def write_hf_dataset(path: Path, texts: list[str]) -> Path:
    import datasets

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    return path


def train_tokenizer(out: Path, vocab: int = 400) -> Path:
    assert main(["data", "tokenizer", "train", PY_GLOB, "--vocab-size", str(vocab), "--out", str(out)]) == 0
    return out


def prepare(out: Path, *sources: str, tokenizer: str = "byte", extra: tuple = ()) -> int:
    return main(["data", "prepare", *sources, "--tokenizer", tokenizer, "--out", str(out), "--no-progress", *extra])


def write_prepared(directory: Path, docs: list[list[int]], val_docs: list[list[int]] = (), vocab: int = 1 << 20,
                   sha: str = "0" * 64) -> Path:
    """A prepared directory written by hand (uint32 ids as given), for sampler checks independent of prepare."""
    import numpy as np

    (directory / "shards").mkdir(parents=True)
    splits = {}
    for split, items in (("train", docs), ("val", val_docs)):
        shards = []
        for n, half in enumerate((items[: len(items) // 2], items[len(items) // 2:])):
            if not half:
                continue
            name = f"shards/{split}-{n:05d}.bin"
            data = np.concatenate([np.asarray(d, dtype="<u4") for d in half]).tobytes()
            (directory / name).write_bytes(data)
            ends = np.cumsum([len(d) for d in half]).tolist()
            shards.append({"file": name, "tokens": ends[-1], "documents": ends,
                           "max_token": max(max(d) for d in half),
                           "sha256": hashlib.sha256(data).hexdigest()})
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": len(items), "shards": shards}
    index = {"format": 1, "dtype": "uint32", "splits": splits, "skipped_documents": 0, "val_fraction": 0.1,
             "sources": [], "tokenizer": {"kind": "hf", "name": "hand", "sha256": sha, "vocab_size": vocab,
                                          "eot_id": 0}}
    (directory / "index.json").write_text(json.dumps(index))
    return directory
