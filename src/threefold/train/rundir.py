"""A run directory belongs to one run.

`DIR/run.json` names the run that owns the directory: a run id, the hash of the `[model]`
section (the run's identity: the shapes its checkpoints hold) and when it started. A new run
never writes into a directory another run owns: it exits 2 with the choices (`--resume auto`
to continue that run, a new `--out`, or `--overwrite`, which moves the old run aside and
never deletes it). `--resume auto` continues only a run of the same model. Without `--out`
every run gets a fresh `runs/<date>-<time>` directory and `runs/latest` points at it.

Plain Python (no torch): the launcher claims the directory before starting any process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

from ..config import Config
from ..errors import ConfigError, UserError

RUN_FILE = "run.json"
RUNS_ROOT = Path("runs")
_STARTUP_FILES = {RUN_FILE, "config.toml", "logs"}  # written before a run's first step


def run_directory(cfg: Config) -> Path:
    """`run.out`, which the library's caller must set (the CLI claims one for every run)."""
    if not cfg.run.out:
        raise ConfigError("run.out", "no run directory; set run.out (the CLI picks runs/<date>-<time> itself)")
    return Path(cfg.run.out)


# `[model]` keys that say how the model is computed, not what it is: a run may resume with another value
NOT_IDENTITY = ("loss_chunk",)


def model_hash(model: dict) -> str:
    """The run's identity: a short hash of its `[model]` section (shapes and architecture)."""
    model = {k: v for k, v in model.items() if k not in NOT_IDENTITY}
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16]


def read_run(out: Path) -> dict | None:
    """The run file of `out`, or None when there is none (or it is unreadable)."""
    try:
        run = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) else None


def default_out(root: Path = RUNS_ROOT) -> Path:
    """A fresh `runs/<date>-<time>` directory (a suffix when two runs start in the same second)."""
    _check_latest(root)  # refused before anything is created
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, n = root / stamp, 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out


def _check_latest(root: Path) -> None:
    """`runs/latest` is threefold's link to the newest run: anything else there is refused, not left stale."""
    latest = root / "latest"
    if latest.exists() and not latest.is_symlink():
        kind = "directory" if latest.is_dir() else "file"
        raise UserError(f"run.out: '{latest}' is a {kind}, not the link to the newest run that threefold keeps "
                        "there; move it away, or pass --out")


def point_latest(out: Path, root: Path = RUNS_ROOT) -> None:
    """Make `runs/latest` a symbolic link to `out` (replaced atomically; anything else there is refused)."""
    latest = root / "latest"
    _check_latest(root)
    tmp = root / f".latest-{uuid.uuid4().hex[:8]}"
    os.symlink(out.name, tmp)
    os.replace(tmp, latest)


def _one_line_os_errors(claim_fn):
    """A run directory the file system refuses (read-only, not ours) is one line naming it, exit 2."""

    @functools.wraps(claim_fn)
    def claiming(cfg: Config, overwrite: bool = False) -> Config:
        try:
            return claim_fn(cfg, overwrite)
        except OSError as e:
            where = f"'{e.filename}'" if e.filename else f"'{cfg.run.out or RUNS_ROOT}'"
            raise ConfigError("run.out", f"cannot write the run directory {where} ({e.strerror or e}); give a "
                              "writable directory with --out") from None

    return claiming


@_one_line_os_errors
def claim(cfg: Config, overwrite: bool = False) -> Config:
    """Make `cfg.run.out` this run's directory; returns the config with `run.out` and `run.id` set.

    Raises UserError (exit 2, one line) when the directory belongs to another run.
    """
    default = not cfg.run.out
    out = default_out() if default else Path(cfg.run.out)
    if out.is_symlink():  # e.g. --out runs/latest: the run it points at
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError("run.out", f"'{out}' is a file, not a directory; give a directory with --out")
    if overwrite and _holds_a_run(out):
        moved = move_aside(out)
        print(f"threefold: moved the previous run in {out} to {moved}", file=sys.stderr, flush=True)
    run_id = _continued_run(out, cfg) if _holds_a_run(out) else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
        out.mkdir(parents=True, exist_ok=True)
        run = {"run_id": run_id, "config_hash": model_hash(cfg.to_dict()["model"]),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_atomic(out / RUN_FILE, json.dumps(run, indent=1) + "\n")
    if default:
        point_latest(out)
    return replace(cfg, run=replace(cfg.run, out=str(out), id=run_id))


def adopt(cfg: Config) -> Config:
    """A restarted process joins the run its first attempt claimed (the id from the run file)."""
    run = read_run(Path(cfg.run.out)) if cfg.run.out else None
    if run is None or cfg.run.id:
        return cfg
    return replace(cfg, run=replace(cfg.run, id=str(run.get("run_id", ""))))


def update_run(out: Path, key: str, value) -> None:
    """Set one entry of the run file (e.g. the checkpoint interval a run chose), atomically."""
    run = read_run(out) or {}
    run[key] = value
    _write_atomic(out / RUN_FILE, json.dumps(run, indent=1) + "\n")


def move_aside(out: Path) -> Path:
    """Rename `out` to `out.old-<date>-<time>` (never deletes anything); returns the new path."""
    target = out.resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved, n = target.with_name(f"{target.name}.old-{stamp}"), 1
    while moved.exists():
        n += 1
        moved = target.with_name(f"{target.name}.old-{stamp}-{n}")
    os.replace(target, moved)
    return moved


def _holds_a_run(out: Path) -> bool:
    """Whether `out` holds what a run produced (a run that failed before its first step left nothing to keep)."""
    return out.is_dir() and any(not p.name.startswith(".") and p.name not in _STARTUP_FILES for p in out.iterdir())


def _choices(out: Path) -> str:
    return (f"continue it with --resume auto, choose a new --out, or pass --overwrite to move it aside "
            f"(to {out.name}.old-<time>)")


def _continued_run(out: Path, cfg: Config) -> str:
    """The id of the run in `out` when this start continues it; raises when it may not."""
    run = read_run(out)
    mine = model_hash(cfg.to_dict()["model"])
    if cfg.checkpoint.resume == "none":
        what = f"run {run.get('run_id', '?')} (started {run.get('started', '?')})" if run else "files of another run"
        raise UserError(f"run.out: '{out}' already holds {what}; {_choices(out)}")
    if run is not None:
        if run.get("config_hash") != mine:
            raise UserError(f"checkpoint.resume: '{out}' holds run {run.get('run_id', '?')} of another model "
                            f"(model hash {run.get('config_hash')} != {mine}); its checkpoints do not fit this "
                            "model: choose a new --out, or pass --overwrite to move it aside")
        return str(run.get("run_id", ""))
    # a directory written before run files existed: its checkpoints name their model
    for manifest in sorted((out / "checkpoints").glob("step-*/manifest.json")):
        try:
            model = json.loads(manifest.read_text()).get("config", {}).get("model")
        except (OSError, ValueError):
            continue
        if model is not None and model_hash(model) != mine:
            raise UserError(f"checkpoint.resume: {manifest.parent} was written by a run of another model; "
                            "choose a new --out, or pass --overwrite to move that run aside")
    run_id = uuid.uuid4().hex[:12]
    run = {"run_id": run_id, "config_hash": mine, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_atomic(out / RUN_FILE, json.dumps(run, indent=1) + "\n")
    return run_id


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)
