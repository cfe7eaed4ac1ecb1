"""Document sources for `data prepare`: text files, directories, globs, JSON Lines, Parquet, HF datasets.

A SOURCE is a file, a directory (every file under it, recursively, hidden ones and
__pycache__ skipped), a glob, or `PATH:FIELD` for JSON Lines / Parquet / a Hugging Face
`datasets` directory (FIELD defaults to "text"). Each text file is one document; each JSON
line, Parquet row or dataset row is one document. Bad input raises UserError naming the file
(and the byte offset or line); with `skip_bad` a document that is not valid UTF-8 is skipped
and counted instead. An empty file holds no document: it becomes an `empty` unit, which
`data prepare` skips and counts (`empty_files` in index.json), never refusing the run for it.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import UserError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_FIELD = "text"
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Unit:
    """One file (or one datasets directory) to read documents from."""

    kind: str  # text | jsonl | parquet | hf | empty (an empty file: no document, skipped and counted)
    path: str
    field: str = ""
    size: int = 0  # bytes on disk (text, jsonl, parquet), for grouping into shards

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path, "field": self.field, "size": self.size}

    @staticmethod
    def from_dict(d: dict) -> "Unit":
        return Unit(d["kind"], d["path"], d["field"], d["size"])


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def split_field(spec: str) -> tuple[str, str]:
    """'data.jsonl:body' -> ('data.jsonl', 'body'); a spec without a field -> (spec, '')."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail and "/" not in tail and (Path(head).exists() or glob.has_magic(head)):
        return head, tail
    return spec, ""


def expand(spec: str) -> list[Unit]:
    """The units of one SOURCE argument, in a fixed (sorted) order."""
    pattern, field = split_field(spec)
    if glob.has_magic(pattern):
        paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
        paths = [p for p in paths if p.is_file() or is_hf_dataset(p)]
        if not paths:
            raise UserError(f"source '{spec}': the glob matches no file; check the pattern")
    else:
        path = Path(pattern)
        if not path.exists():
            raise UserError(f"source '{spec}': '{pattern}' does not exist; give a file, directory, glob or PATH:FIELD")
        paths = [path]
    units = []
    for path in paths:
        if path.is_dir() and not is_hf_dataset(path):
            files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            if not files:
                raise UserError(f"source '{spec}': directory '{path}' holds no files")
            units.extend(_unit(p, field) for p in files)
        else:
            units.append(_unit(path, field))
    return units


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def _unit(path: Path, field: str) -> Unit:
    if is_hf_dataset(path):
        return Unit("hf", str(path), field or DEFAULT_FIELD)
    size = path.stat().st_size
    if size == 0 and path.is_file():
        return Unit("empty", str(path), field, 0)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return Unit("jsonl", str(path), field or DEFAULT_FIELD, size)
    if suffix in PARQUET_SUFFIXES:
        return Unit("parquet", str(path), field or DEFAULT_FIELD, size)
    if field:
        raise UserError(f"source '{path}:{field}': a field applies to JSON Lines (.jsonl), Parquet (.parquet) "
                        "or a datasets directory, not to a text file; drop ':FIELD'")
    return Unit("text", str(path), "", size)


class Skipped:
    """Counts documents skipped for invalid UTF-8 (with data.skip_bad_documents)."""

    def __init__(self):
        self.count = 0
        self.first: str = ""

    def add(self, where: str) -> None:
        self.count += 1
        self.first = self.first or where


def _decode(raw: bytes, where: str, skip_bad: bool, skipped: Skipped, base_offset: int = 0) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if skip_bad:
            skipped.add(where)
            return None
        raise UserError(f"source file '{where}' is not valid UTF-8 at byte offset {base_offset + e.start}; fix "
                        "the file or set data.skip_bad_documents=true (--skip-bad-documents)") from None


def documents(unit: Unit, skip_bad: bool, skipped: Skipped) -> Iterator[list[str]]:
    """The unit's documents, in batches."""
    if unit.kind == "empty":
        return
    if unit.kind == "text":
        text = _decode(Path(unit.path).read_bytes(), unit.path, skip_bad, skipped)
        if text is not None:
            yield [text]
    elif unit.kind == "jsonl":
        yield from _jsonl(unit, skip_bad, skipped)
    elif unit.kind == "parquet":
        yield from _parquet(unit)
    elif unit.kind == "hf":
        yield from _hf_dataset(unit)
    else:
        raise ValueError(unit.kind)


def _jsonl(unit: Unit, skip_bad: bool, skipped: Skipped) -> Iterator[list[str]]:
    batch, offset = [], 0
    with open(unit.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{unit.path}:{number}"
            line = _decode(raw, unit.path, skip_bad, skipped, offset)
            offset += len(raw)
            if line is None or not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"source file '{where}' (line {number}) is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or unit.field not in row:
                raise UserError(f"source file '{unit.path}' line {number} has no field '{unit.field}'; "
                                f"name the field as {unit.path}:FIELD")
            value = row[unit.field]
            if not isinstance(value, str):
                raise UserError(f"source file '{unit.path}' line {number}: field '{unit.field}' is "
                                f"{type(value).__name__}, not text")
            batch.append(value)
            if len(batch) >= _BATCH_ROWS:
                yield batch
                batch = []
    if batch:
        yield batch


def _parquet(unit: Unit) -> Iterator[list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(unit.path)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"source file '{unit.path}' is not a readable Parquet file ({e})") from None
    names = file.schema_arrow.names
    if unit.field not in names:
        raise UserError(f"source file '{unit.path}' has no column '{unit.field}' (columns: {', '.join(names)}); "
                        f"name it as {unit.path}:COLUMN")
    for batch in file.iter_batches(batch_size=_BATCH_ROWS, columns=[unit.field]):
        yield [v for v in batch.column(0).to_pylist() if v is not None]


def _hf_dataset(unit: Unit) -> Iterator[list[str]]:
    import datasets

    dataset = datasets.load_from_disk(unit.path)
    if isinstance(dataset, datasets.DatasetDict):
        raise UserError(f"source '{unit.path}' is a dataset dictionary with splits {', '.join(dataset)}; "
                        f"give one split's directory, e.g. {unit.path}/{next(iter(dataset))}")
    if unit.field not in dataset.column_names:
        raise UserError(f"source '{unit.path}' has no column '{unit.field}' (columns: "
                        f"{', '.join(dataset.column_names)}); name it as {unit.path}:COLUMN")
    for rows in dataset.select_columns([unit.field]).iter(batch_size=_BATCH_ROWS):
        yield [v for v in rows[unit.field] if v is not None]
