"""A run directory belongs to one run.

`DIR/run.json` names the run that owns the directory: a run id, the hash of the `[model]`
section (the run's identity: the shapes its checkpoints hold) and when it started. A new run
never writes into a directory another run owns: it exits 2 with the choices (`--resume auto`
to continue that run, a new `--out`, or `--overwrite`, which moves the old run aside and
never deletes it). `--resume auto` continues only a run of the same model. Without `--out`
every run gets a fresh `runs/<date>-<time>` directory and `runs/latest` points at it.

While a run runs, it holds an exclusive kernel lock (`fcntl.flock`) on `DIR/.lock`, which names
its host and pid, and one on the directory `DIR` itself, which `rm DIR/.lock` cannot take away: a
second run started there, at the same instant or later (or after `.lock` was removed), exits 2
naming the holder, and `--overwrite` refuses to move a running run aside. The kernel releases the
locks when the holder ends, however it ends (a kill too), so a stale `.lock` file never blocks a
new run.

A resume takes only its own run's state (`check_resume`): `--resume auto` refuses a checkpoint of
another run, and an explicit `--resume PATH` refuses a checkpoint of a model that computes another
function (`FUNCTION_FIELDS`); `checkpoint.init_from` starts a new run from another model's weights.

Plain Python (no torch): the launcher claims the directory before starting any process.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import socket
import stat
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

from ..config import Config
from ..config.sections import ModelConfig
from ..errors import ConfigError, UserError

RUN_FILE = "run.json"
LOCK_FILE = ".lock"  # flock-ed (with the directory) by the run that runs in the directory; holds its host and pid
RUNS_ROOT = Path("runs")
_STARTUP_FILES = {RUN_FILE, "config.toml", "logs"}  # written before a run's first step


def run_directory(cfg: Config) -> Path:
    """`run.out`, which the library's caller must set (the CLI claims one for every run)."""
    if not cfg.run.out:
        raise ConfigError("run.out", "no run directory; set run.out (the CLI picks runs/<date>-<time> itself)")
    return Path(cfg.run.out)


# `[model]` keys that say how the model is computed, not what it is: a run may resume with another value
NOT_IDENTITY = ("loss_chunk",)


# `[model]` keys added after run directories existed, with their defaults: left out of the hash while at
# them, so a run.json written before the key still names the same run
ADDED_LATER = {"router_balance": "aux", "router_bias_rate": 0.001, "router_seq_aux_weight": 0.0001, "mtp_depth": 0,
               "mtp_weight": 0.3}


def model_hash(model: dict) -> str:
    """The run's identity: a short hash of its `[model]` section (shapes and architecture)."""
    model = {k: v for k, v in model.items() if k not in NOT_IDENTITY and ADDED_LATER.get(k, model) != v}
    if not model.get("lora_rank"):  # without LoRA its keys say nothing: hashes of runs from before them hold
        model = {k: v for k, v in model.items() if not k.startswith("lora_")}
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16]


def read_run(out: Path) -> dict | None:
    """The run file of `out`, or None when there is none (or it is unreadable)."""
    try:
        run = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) else None


def default_out(root: Path = RUNS_ROOT) -> Path:
    """A fresh `runs/<date>-<time>` directory, created here (a suffix when two runs start in the
    same second: the creation is atomic, so two runs never pick the same one)."""
    _check_latest(root)  # refused before anything is created
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    out, n = root / stamp, 1
    while True:
        try:
            out.mkdir()
            return out
        except FileExistsError:
            n += 1
            out = root / f"{stamp}-{n}"


class RunLock:
    """The exclusive lock of a run on its directory, held until `release` or until the process ends; the
    kernel drops it when the holder dies, however it dies. Two flocks: on `DIR/.lock` (which names the
    holder) and on the directory itself, which `rm DIR/.lock` cannot take away (None where the file
    system cannot lock a directory)."""

    def __init__(self, path: Path, fd: int, dir_fd: int | None = None):
        self.path, self._fd, self._dir_fd = path, fd, dir_fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # still held: the next holder's lock file names only the next holder
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def lock_directory(out: Path, overwrite: bool = False) -> RunLock:
    """Take the exclusive lock of directory `out` (created if absent) for this process.

    Raises UserError (exit 2, one line naming the holder's host and pid) when another process holds
    it, also when its `DIR/.lock` was removed (the holder still holds the directory). Atomic: of any
    number of processes starting at the same instant exactly one gets it.
    """
    path = out / LOCK_FILE
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError("run.out", f"cannot create the run directory's lock file {path} ({e.strerror}); "
                              "choose a writable --out") from None
        try:  # the file, then the directory: one finds the directory held only when its .lock was removed
            _flock(fd, out, overwrite, lambda: _holder(fd))
            if not _flock(dir_fd, out, overwrite, lambda: _directory_holder(dir_fd)):
                os.close(dir_fd)  # the file system cannot lock a directory: the file's lock alone guards it
                dir_fd = None
        except BaseException:
            os.close(fd)
            if dir_fd is not None:
                os.close(dir_fd)
            raise
        if _same_file(path, fd) and (dir_fd is None or _same_file(out, dir_fd)):
            break
        os.close(fd)  # the directory was moved aside (--overwrite) between open and lock: lock the new one
        if dir_fd is not None:
            os.close(dir_fd)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n")
              .encode(), 0)
    return RunLock(path, fd, dir_fd)


def _flock(fd: int, out: Path, overwrite: bool, holder) -> bool:
    """Take the flock of `fd` (the lock file or the directory); raises UserError naming `holder()` when
    another process holds it. False when the file system cannot lock this kind of file (a directory on
    some network mounts); the lock file's own refusal is ConfigError."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        if overwrite:
            raise UserError(f"run.out: '{out}' is in use by a run that is still running ({holder()}); --overwrite "
                            "moves aside only a run that has ended: stop that run first, or choose a new "
                            "--out") from None
        raise UserError(f"run.out: '{out}' is in use by a run that is still running ({holder()}); wait for it to "
                        "end (then --resume auto continues it), or choose a new --out") from None
    except OSError as e:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            return False
        raise ConfigError("run.out", f"cannot lock {out / LOCK_FILE} ({e.strerror}): the file system of --out does "
                          "not support file locks; choose --out on another file system") from None


def _same_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the file (or directory) open as `fd`."""
    try:
        here, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int, wait_s: float = 10.0) -> str:
    """`host H, pid P, since T` from a lock file another process holds (it writes them just after
    taking the lock: wait a moment for them). A holder that ended cleanly emptied the file; one that
    was killed left its own lines there, which name a process of this host that no longer runs:
    both are read again until the new holder has written its own."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode())
            if info["host"] != socket.gethostname() or _running(int(info["pid"])):
                return f"host {info['host']}, pid {info['pid']}, since {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            return "a process that has not written its host and pid"
        time.sleep(0.01)


def _directory_holder(dir_fd: int) -> str:
    """`host H, pid P, ...` of the process that holds the flock of the directory open as `dir_fd`, from the
    kernel's table of locks (Linux /proc/locks: `N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF`, the
    device numbers in hex): its lock file, which would name it, was removed."""
    st = os.fstat(dir_fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        table = []
    for line in table:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and int(fields[4]) > 0:
            return f"host {socket.gethostname()}, pid {fields[4]}, whose {LOCK_FILE} was removed"
    return f"a process that holds the directory, whose {LOCK_FILE} was removed"


def _running(pid: int) -> bool:
    """Whether process `pid` of this host still runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


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
    def claiming(cfg: Config, overwrite: bool = False) -> tuple[Config, RunLock]:
        try:
            return claim_fn(cfg, overwrite)
        except OSError as e:
            where = f"'{e.filename}'" if e.filename else f"'{cfg.run.out or RUNS_ROOT}'"
            raise ConfigError("run.out", f"cannot write the run directory {where} ({e.strerror or e}); give a "
                              "writable directory with --out") from None

    return claiming


@_one_line_os_errors
def claim(cfg: Config, overwrite: bool = False) -> tuple[Config, RunLock]:
    """Make `cfg.run.out` this run's directory; returns the config with `run.out` and `run.id` set,
    and the directory's lock, which the caller holds for the run's whole life (see RunLock).

    Raises UserError (exit 2, one line) when the directory belongs to another run, or another
    process holds its lock (a run still running there).
    """
    default = not cfg.run.out
    out = default_out() if default else Path(cfg.run.out)
    if out.is_symlink():  # e.g. --out runs/latest: the run it points at
        out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError("run.out", f"'{out}' is a file, not a directory; give a directory with --out")
    lock = lock_directory(out, overwrite)  # before anything is read or written there
    try:
        if overwrite and _holds_a_run(out):
            moved = move_aside(out)  # the lock goes with it: no one claims the old run while it moves
            print(f"threefold: moved the previous run in {out} to {moved}", file=sys.stderr, flush=True)
            lock.release()
            lock = lock_directory(out, overwrite)
        run_id = _continued_run(out, cfg) if _holds_a_run(out) else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            run = {"run_id": run_id, "config_hash": model_hash(cfg.to_dict()["model"]),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            _write_atomic(out / RUN_FILE, json.dumps(run, indent=1) + "\n")
        if default:
            point_latest(out)
    except BaseException:
        lock.release()
        raise
    return replace(cfg, run=replace(cfg.run, out=str(out), id=run_id)), lock


# keys of a run's config.toml that a resumed run does not take from it: a fault is injected once, the
# progress bar belongs to the terminal, the run id is the run file's
# not taken from the run's config.toml on a resume: test faults, this terminal's progress bar, the id (run.json's),
# and the layout that depends on the world the resume has (dp and the micro-batches: an elastic job shrunk to
# fewer nodes wrote its re-derived ones; the step's math does not depend on them)
NOT_RESUMED = ("fault", "run.progress", "run.id", "parallel.dp", "train.microbatches")


def resume_defaults(cfg: Config) -> Path | None:
    """The run's own DIR/config.toml when `cfg` resumes the run in `run.out` (checkpoint.resume not none)
    and it exists: the default of the resumed run's config, under the options given again."""
    if cfg.checkpoint.resume == "none" or not cfg.run.out:
        return None
    path = Path(cfg.run.out) / "config.toml"
    return path if path.is_file() else None


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
    # a directory written before run files existed (or whose run file was lost): its checkpoints
    # name their model, and the run that wrote them, which this start continues
    run_id = ""
    for manifest in sorted((out / "checkpoints").glob("step-*/manifest.json")):
        try:
            written = json.loads(manifest.read_text()).get("config", {})
            model, run = written.get("model"), written.get("run", {})
        except (OSError, ValueError, AttributeError):
            continue
        if model is not None and model_hash(model) != mine:
            raise UserError(f"checkpoint.resume: {manifest.parent} was written by a run of another model; "
                            "choose a new --out, or pass --overwrite to move that run aside")
        if isinstance(run, dict) and run.get("id"):
            run_id = str(run["id"])
    run_id = run_id or uuid.uuid4().hex[:12]
    run = {"run_id": run_id, "config_hash": mine, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_atomic(out / RUN_FILE, json.dumps(run, indent=1) + "\n")
    return run_id


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------ what a resume may take

# `[model]` fields that do not change the function a checkpoint's weights compute, and why; every
# other field of ModelConfig (a field added later too) must be equal for a resume to take a checkpoint
NOT_FUNCTION = {
    "preset": "a name for the values of the other fields, which are compared themselves",
    "loss_chunk": "how the loss is computed (in pieces or at once), not what it is",
    "init_std": "the initial values, which the checkpoint's replace",
    "router_aux_weight": "a weight of the training loss (like the learning rate), not of the model",
    "router_z_weight": "a weight of the training loss (like the learning rate), not of the model",
    "router_seq_aux_weight": "a weight of the training loss (like the learning rate), not of the model",
    "router_bias_rate": "how fast the routing bias moves (like the learning rate); the bias itself is in the checkpoint",
    "mtp_weight": "a weight of the training loss (like the learning rate), not of the model",
}
FUNCTION_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in NOT_FUNCTION)
_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def model_differences(written: dict, model: dict) -> list[str]:
    """`field a -> b` for each function-changing field in which model config `written` (a
    checkpoint's; a missing field is the default it had when it did not exist) differs from `model`."""
    out = []
    for name in FUNCTION_FIELDS:
        theirs, mine = written.get(name, _MODEL_DEFAULTS[name]), model.get(name, _MODEL_DEFAULTS[name])
        if theirs != mine:
            out.append(f"{name} {theirs} -> {mine}")
    return out


def check_resume(ckpt: Path, written: dict, cfg: Config) -> None:
    """Raise UserError (exit 2, one line) unless the run of `cfg` may resume checkpoint `ckpt`, whose
    writer's config is `written` (the manifest's `config`).

    `--resume auto` takes only a checkpoint of this directory's run (the run id of run.json, which
    `cfg.run.id` carries); any resume takes only a checkpoint of a model computing the same function.
    """
    if cfg.checkpoint.resume == "auto":
        mine = cfg.run.id
        if not mine and cfg.run.out:  # a library caller that did not claim the directory
            mine = str((read_run(Path(cfg.run.out)) or {}).get("run_id", ""))
        run = written.get("run")
        theirs = str(run.get("id", "")) if isinstance(run, dict) else ""
        if mine and theirs and theirs != mine:  # "": written before run ids (its model is compared below)
            raise UserError(f"checkpoint.resume: {ckpt} belongs to run {theirs}, not to run {mine} of "
                            f"{Path(cfg.run.out) / RUN_FILE}; --resume auto continues only its own run: move that "
                            f"checkpoint out of the directory, or continue it with --resume {ckpt} and a new --out")
    model = written.get("model")
    if not isinstance(model, dict):
        raise UserError(f"checkpoint.resume: {ckpt} does not say which model wrote it (no config.model in its "
                        "manifest), so it cannot be resumed; start a new run from its weights with "
                        "checkpoint.init_from (threefold ckpt export writes them)")
    diff = model_differences(model, cfg.to_dict()["model"])
    if diff:
        raise UserError(f"checkpoint.resume: {ckpt} was written by another model ({', '.join(diff)}): a resume "
                        "continues the same model; to start a new run from its weights, export them (threefold "
                        "ckpt export) and pass --set checkpoint.init_from=FILE, or give the model of the checkpoint")
