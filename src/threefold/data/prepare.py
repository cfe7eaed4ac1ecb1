"""`threefold data prepare`: sources -> memory-mapped token shards + a JSON index.

The sources are expanded into units (files) in a fixed order and grouped into tasks (text
files up to `shard_bytes` per task; each JSON Lines, Parquet file or datasets directory is a
task of its own). Worker processes tokenize the tasks; each writes `shards/train-NNNNN.bin`
and `shards/val-NNNNN.bin` (little-endian uint16 or uint32, every document followed by the
tokenizer's end-of-text id) and then, as its commit point, `parts/NNNNN.json`. A document
goes to the validation split when a hash of (file, document number) falls below
`val_fraction`: the split does not depend on the workers or on an interruption. A rerun
after an interruption keeps committed tasks and redoes the rest, so the shards come out
byte-identical. `index.json`, written last, lists the shards with their token counts,
document boundaries, largest id and SHA-256, and the tokenizer's identity.

All of it is written into a hidden sibling of `--out` (`work_dir`: `.NAME.preparing`), renamed to
`--out` once the index is written: a killed or failed preparation leaves nothing at `--out`,
so nothing there can be trained on half-made, and running the command again resumes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..errors import UserError
from .documents import Skipped, Unit, documents, expand
from .tokenizer import TOKENIZER_FILE, load_tokenizer

FORMAT = 1
INDEX = "index.json"
PLAN = "plan.json"
SPLITS = ("train", "val")
# A test hook: with this set to N and one worker (the tasks run in the command's process), the
# command kills itself (SIGKILL, as an OOM kill would) right after the N-th task of this run is
# committed, so a test interrupts a preparation at a point the preparation reaches instead of
# racing it. Unset (as always outside the tests): nothing happens.
KILL_AFTER_ENV = "THREEFOLD_PREPARE_KILL_AFTER"


@dataclass(frozen=True)
class PrepareOptions:
    sources: list[str]
    tokenizer: str | None  # a directory with tokenizer.json, or None / "byte"
    out: Path
    val_fraction: float = 0.01
    workers: int = 0  # 0: one per core, at most one per task
    shard_bytes: int = 16 << 20
    skip_bad: bool = False
    progress: bool = True


def group_tasks(units: list[Unit], shard_bytes: int) -> list[list[Unit]]:
    tasks, current, size = [], [], 0
    for unit in units:
        if unit.kind != "text":
            if current:
                tasks.append(current)
                current, size = [], 0
            tasks.append([unit])
            continue
        current.append(unit)
        size += unit.size
        if size >= shard_bytes:
            tasks.append(current)
            current, size = [], 0
    if current:
        tasks.append(current)
    return tasks


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def goes_to_val(path: str, number: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{path}\0{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * (1 << 64)


# ---------------------------------------------------------------- worker side

_TOKENIZER = None


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux), and leave now if it already has:
    a killed `data prepare` leaves no worker running orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)


def _init_worker(tokenizer: str | None, parent: int | None = None) -> None:
    global _TOKENIZER
    if parent is not None:
        _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _TOKENIZER = load_tokenizer(tokenizer)


class _ShardWriter:
    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = path, np.dtype(dtype).newbyteorder("<")
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()
        self.tokens, self.ends, self.max_token = 0, [], -1

    def add(self, ids: list[int], eot: int) -> None:
        array = np.asarray(ids + [eot], dtype=self.dtype)
        data = array.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += array.size
        self.ends.append(self.tokens)
        self.max_token = max(self.max_token, int(array.max()))

    def close(self, relative: str) -> dict | None:
        self.file.close()
        if self.tokens == 0:
            self.tmp.unlink()
            return None
        os.replace(self.tmp, self.path)
        return {"file": relative, "tokens": self.tokens, "documents": self.ends, "max_token": self.max_token,
                "sha256": self.sha.hexdigest()}


def run_task(index: int, units: list[dict], out: str, val_fraction: float, dtype: str, skip_bad: bool) -> dict:
    """Tokenize one task into its shards and commit it (parts/NNNNN.json). Runs in a worker."""
    start = time.perf_counter()
    tok, out_dir = _TOKENIZER, Path(out)
    eot = tok.identity.eot_id
    writers = {s: _ShardWriter(out_dir / "shards" / f"{s}-{index:05d}.bin", dtype) for s in SPLITS}
    skipped = Skipped()
    for unit in map(Unit.from_dict, units):
        number = 0
        for batch in documents(unit, skip_bad, skipped):
            for ids in tok.encode_batch(batch):
                split = "val" if goes_to_val(unit.path, number, val_fraction) else "train"
                writers[split].add(ids, eot)
                number += 1
    part = {"task": index, "skipped": skipped.count, "first_skipped": skipped.first,
            "shards": {s: w.close(f"shards/{s}-{index:05d}.bin") for s, w in writers.items()}}
    _write_json(out_dir / "parts" / f"{index:05d}.json", part)
    tokens = sum(e["tokens"] for e in part["shards"].values() if e)
    return {"part": part, "tokens": tokens, "seconds": time.perf_counter() - start,
            "bytes": sum(u["size"] for u in units)}


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- driver side


def _plan(opts: PrepareOptions, identity, tasks: list[list[Unit]]) -> dict:
    return {"format": FORMAT, "tokenizer": identity.to_dict(), "dtype": token_dtype(identity.vocab_size),
            "val_fraction": opts.val_fraction, "skip_bad_documents": opts.skip_bad, "sources": list(opts.sources),
            "tasks": [[u.to_dict() for u in task] for task in tasks]}


def work_dir(out: Path) -> Path:
    """Where the preparation of `out` is written until it is complete: the hidden sibling `.NAME.preparing`,
    renamed to `out` only once its index is written, so `out` never holds an unfinished preparation."""
    target = Path(os.path.realpath(out))
    if not target.name:
        raise UserError(f"--out '{out}' is the file system's root; choose a directory below it")
    return target.with_name(f".{target.name}.preparing")


def _start(opts: PrepareOptions, plan: dict) -> Path | None:
    """The directory to prepare into (`work_dir`, created, or resumed after an interruption), or None
    when `--out` already holds this very preparation."""
    out, work = opts.out, work_dir(opts.out)
    if (out / PLAN).is_file():
        done = (out / INDEX).is_file()
        if done and json.loads((out / PLAN).read_text()) == plan:
            return None
        if done:
            raise UserError(f"--out '{out}' holds the preparation of other sources, options or tokenizer; "
                            "choose a new --out directory or remove it")
        if work.exists():
            raise UserError(f"--out '{out}' holds an unfinished preparation and '{work}' another one; "
                            "remove one of them and run again")
        os.replace(out, work)  # unfinished (an earlier version prepared in place): finished in the sibling
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out '{out}' exists and is not a data directory of `data prepare`; choose a new one")
    plan_path = work / PLAN
    if plan_path.is_file():
        if json.loads(plan_path.read_text()) == plan:
            return work
        print(f"threefold: '{work}' holds an unfinished preparation of other sources or options; starting it over",
              file=sys.stderr)
        for sub in ("shards", "parts", "tokenizer"):
            shutil.rmtree(work / sub, ignore_errors=True)
        (work / INDEX).unlink(missing_ok=True)
        plan_path.unlink()
    if work.exists() and any(work.iterdir()):
        raise UserError(f"'{work}', where `data prepare` writes --out '{out}' until it is complete, holds files "
                        "it did not write; move them away")
    for sub in ("shards", "parts"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    if opts.tokenizer not in (None, "byte"):
        (work / "tokenizer").mkdir(exist_ok=True)
        for name in (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(opts.tokenizer) / name).is_file():
                shutil.copyfile(Path(opts.tokenizer) / name, work / "tokenizer" / name)
    _write_json(plan_path, plan)
    return work


def _finish(work: Path, out: Path) -> None:
    """Rename the complete preparation to `out` (replacing an empty directory there): one step, so `out`
    holds either nothing of it or all of it."""
    try:
        os.replace(work, os.path.realpath(out))
    except OSError as e:
        raise UserError(f"--out '{out}' cannot take the finished preparation in '{work}' ({e.strerror}); "
                        f"move '{out}' away and rename '{work}' to it") from None


def _committed(out: Path, index: int, itemsize: int) -> dict | None:
    """The part record of a task committed by an earlier run, if its shards are all there."""
    path = out / "parts" / f"{index:05d}.json"
    if not path.is_file():
        return None
    part = json.loads(path.read_text())
    for entry in part["shards"].values():
        shard = out / entry["file"] if entry else None
        if shard is not None and (not shard.is_file() or shard.stat().st_size != entry["tokens"] * itemsize):
            return None
    return part


def prepare(opts: PrepareOptions) -> dict:
    """Run (or finish) a preparation; returns the index and a throughput summary."""
    if not 0 <= opts.val_fraction < 1:
        raise UserError(f"--val-fraction: must be in [0, 1), got {opts.val_fraction}")
    tokenizer = load_tokenizer(opts.tokenizer)
    units = [u for spec in opts.sources for u in expand(spec)]
    empty = [u for u in units if u.kind == "empty"]  # no document: skipped, counted in the index
    tasks = group_tasks([u for u in units if u.kind != "empty"], opts.shard_bytes)
    plan = _plan(opts, tokenizer.identity, tasks)
    work = _start(opts, plan)
    if work is None:
        return {"index": json.loads((opts.out / INDEX).read_text()), "tokens": 0, "worker_seconds": 0.0,
                "seconds": 0.0, "workers": 0, "already": True}
    itemsize = np.dtype(plan["dtype"]).itemsize
    parts = {i: p for i in range(len(tasks)) if (p := _committed(work, i, itemsize)) is not None}
    todo = [i for i in range(len(tasks)) if i not in parts]
    workers = max(1, min(opts.workers or os.cpu_count() or 1, len(todo) or 1))
    start, tokens, busy = time.perf_counter(), 0, 0.0
    committed = _kill_after(os.environ)
    bar = _bar(opts.progress, sum(u.size for i in todo for u in tasks[i]))
    if todo and workers == 1:  # in this process: no start-up cost
        global _TOKENIZER
        _TOKENIZER = tokenizer
        for i in todo:
            tokens, busy = _collect(parts, run_task(i, [u.to_dict() for u in tasks[i]], str(work),
                                                    opts.val_fraction, plan["dtype"], opts.skip_bad), bar, tokens, busy)
            committed()
    elif todo:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                 initargs=(opts.tokenizer, os.getpid())) as pool:
            futures = [pool.submit(run_task, i, [u.to_dict() for u in tasks[i]], str(work), opts.val_fraction,
                                   plan["dtype"], opts.skip_bad) for i in todo]
            for future in as_completed(futures):
                try:
                    done = future.result()
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    raise
                tokens, busy = _collect(parts, done, bar, tokens, busy)
    if bar is not None:
        bar.close()
    index = _write_index(opts, work, plan, [parts[i] for i in range(len(tasks))], len(empty))
    _finish(work, opts.out)
    return {"index": index, "tokens": tokens, "worker_seconds": busy, "seconds": time.perf_counter() - start,
            "workers": workers, "already": False}


def _kill_after(env: Mapping[str, str]) -> Callable[[], None]:
    """What runs after each task this run commits: the `KILL_AFTER_ENV` test hook."""
    limit, count = int(env.get(KILL_AFTER_ENV) or 0), 0

    def committed() -> None:
        nonlocal count
        count += 1
        if count == limit:
            os.kill(os.getpid(), signal.SIGKILL)

    return committed


def _collect(parts: dict, done: dict, bar, tokens: int, busy: float) -> tuple[int, float]:
    parts[done["part"]["task"]] = done["part"]
    tokens += done["tokens"]
    if bar is not None:
        bar.update(done["bytes"])
        bar.set_postfix(tokens=tokens)
    return tokens, busy + done["seconds"]


def _bar(progress: bool, total: int):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="prepare", unit="B", unit_scale=True, dynamic_ncols=True, mininterval=0.5)


def _write_index(opts: PrepareOptions, work: Path, plan: dict, parts: list[dict], empty_files: int = 0) -> dict:
    splits = {}
    for split in SPLITS:
        shards = [p["shards"][split] for p in parts if p["shards"][split]]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(len(s["documents"]) for s in shards), "shards": shards}
    if splits["train"]["tokens"] == 0:
        raise UserError(f"data prepare: the sources {' '.join(opts.sources)} gave no training tokens; "
                        "give more text or a smaller --val-fraction")
    skipped = sum(p["skipped"] for p in parts)
    index = {"format": FORMAT, "tokenizer": plan["tokenizer"], "dtype": plan["dtype"],
             "val_fraction": plan["val_fraction"], "sources": plan["sources"], "skipped_documents": skipped,
             "empty_files": empty_files, "splits": splits}
    _write_json(work / INDEX, index)
    return index
