"""Small corpora for the data tests: stdlib Python files, a JSON Lines file, a Parquet file and a
`datasets` directory, written into a temporary directory (nothing is downloaded)."""

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
