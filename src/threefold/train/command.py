"""`threefold train`: options of the interface contract mapped onto config keys.

Importing this module does not import torch: `threefold train --help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import typing
from pathlib import Path

from ..config import Config, load_config
from ..errors import ConfigError, UserError
from ..config.presets import PRESETS

# option -> config key; every value goes through the config parser, so errors name the key.
OPTION_KEYS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "zero": "parallel.zero",
    "model": "model.preset", "schedule": "pipeline.schedule", "microbatches": "train.microbatches",
    "virtual_stages": "pipeline.virtual_stages", "precision": "precision.compute",
    "activation_checkpointing": "remat.policy", "compress": "compress.method", "steps": "train.steps",
    "global_batch": "train.global_batch", "seq_len": "train.seq_len", "lr": "train.lr", "seed": "train.seed",
    "data": "data.source", "out": "run.out", "save_every": "checkpoint.save_every", "resume": "checkpoint.resume",
    "mtbf_hours": "checkpoint.mtbf_hours",
    # the optimizer and its schedule
    "optimizer": "train.optimizer", "beta1": "train.beta1", "beta2": "train.beta2", "eps": "train.eps",
    "weight_decay": "train.weight_decay", "grad_clip": "train.grad_clip", "warmup_steps": "train.warmup_steps",
    "min_lr_ratio": "train.min_lr_ratio",
    "threads": "run.threads",
}
FLAG_KEYS = {"async_save": "checkpoint.async_save", "deterministic": "train.deterministic",
             "peer_checkpoint": "checkpoint.peer_copy", "compile": "train.compile"}
_NOTES = {  # what an option is for, where its domain (config/domains.py) and type do not say
    "parallel.ep": "expert parallelism: ep ranks of dp share the experts",
    "run.out": "default: a fresh runs/<date>-<time>, linked from runs/latest",
    "checkpoint.resume": "auto = the newest checkpoint of this run that verifies",
    "checkpoint.save_every": "auto = the Young/Daly interval from the measured save stall and step "
    "time and --mtbf-hours (docs/checkpoint.md)",
    "checkpoint.mtbf_hours": "mean time between failures of one GPU, for --save-every auto",
    "train.beta1": "adamw", "train.beta2": "adamw", "train.eps": "adamw",
    "train.weight_decay": "adamw: decoupled; sgd: L2 added to the gradient",
    "train.grad_clip": "clip by global norm", "train.warmup_steps": "linear warm-up of the lr",
    "train.min_lr_ratio": "the cosine decay ends at lr x this",
    "run.threads": "torch's CPU threads per process; 0 = OMP_NUM_THREADS when set, else cores / local processes",
}


def _describe(key: str) -> str:
    """`sets KEY; domain; note; (default D)` from the config's own types, domains (config/domains.py) and
    defaults."""
    from ..config.domains import describe

    section, name = key.split(".")
    cls = typing.get_type_hints(Config)[section]
    kind = typing.get_type_hints(cls)[name]
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    parts = [f"sets {key}"]
    words = [str(a) for member in typing.get_args(kind) if typing.get_origin(member) is typing.Literal
             for a in typing.get_args(member)]
    if key == "model.preset":
        parts.append("one of " + ", ".join(PRESETS) + ", hf:DIR or py:MODULE:FACTORY")
    elif typing.get_origin(kind) is typing.Literal:
        parts.append("one of " + ", ".join(map(str, typing.get_args(kind))))
    elif describe(key):  # a union's words (int | Literal["auto"]) after the domain of its numbers
        parts.append(describe(key) + "".join(f", or {w}" for w in words))
    if key in _NOTES:
        parts.append(_NOTES[key])
    if key != "run.out" and not isinstance(default, bool):
        parts.append(f"default {default}")
    return "; ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with any config key; the options below override it")
    p.add_argument("--nproc", type=int, help="local processes to start (ignored inside a launched world)")
    p.add_argument("--port", type=int, help="rendezvous port for --nproc (default: a free one)")
    p.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes of a multi-node job (with --node-rank, "
                   "--rdzv-endpoint and --nproc per node); default 1, or Slurm's when run by srun once per node")
    p.add_argument("--node-rank", type=int, help="this node's rank; 0 hosts the rendezvous (default 0)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet: node rank 0's host and a "
                   "free port, the same on every node")
    p.add_argument("--rdzv-timeout", type=float, help="seconds to wait for the endpoint and the other nodes "
                   "(default 300)")
    p.add_argument("--rdzv-last-call", type=float, help="--nnodes MIN:MAX: once MIN nodes are there, seconds to "
                   "wait for more before starting (default 30)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the local world after a failure "
                   "(default 0)")
    for option, key in OPTION_KEYS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, metavar="V", help=_describe(key))
    for option, key in FLAG_KEYS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, action="store_true", help=f"sets {key}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, repeatable, e.g. --set model.layers=4")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-compile", action="store_true", help="sets train.compile=false: eager on CUDA too (the "
                   "default, auto, compiles per block on CUDA where known to work, and runs eager on the CPU)")
    p.add_argument("--overwrite", action="store_true",
                   help="--out holds another run: move it aside to OUT.old-<time> (nothing is deleted)")
    p.add_argument("--verbose", action="store_true",
                   help="show every rank's output and the launcher's log here (default: in OUT/logs/rank-N.log)")
    # set by the local launcher for the processes it starts: the run directory is already claimed
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # set by a multi-node launcher: global rank 0 claims the run directory, as under torchrun
    p.add_argument("--node-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)


def overrides_from(args: argparse.Namespace) -> list[str]:
    out = [f"{key}={getattr(args, option)}" for option, key in OPTION_KEYS.items()
           if getattr(args, option) is not None]
    out += [f"{key}=true" for option, key in FLAG_KEYS.items() if getattr(args, option)]
    if args.no_progress:
        out.append("run.progress=false")
    if args.no_compile:
        out.append("train.compile=false")
    return out + list(args.overrides)


_LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.cp")  # the factors a world-size error ("parallel") names


def _resumed_origin(args: argparse.Namespace, field: str) -> str:
    """Which parallel.* values behind an error on `field` a resume took from the run's own config.toml
    (`rundir.resume_defaults`), and how to override them; "" when none did."""
    import tomllib

    from ..config.sections import ParallelConfig
    from . import rundir

    if args.config is not None or not field.startswith("parallel"):
        return ""
    path = rundir.resume_defaults(load_config(None, overrides_from(args)))
    if path is None:
        return ""
    given = {item.partition("=")[0].strip() for item in overrides_from(args)}
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    options = {key: option.replace("_", "-") for option, key in OPTION_KEYS.items()}
    named, passed, sets = [], [], []
    for name, value in tomllib.loads(path.read_text(encoding="utf-8")).get("parallel", {}).items():
        key = f"parallel.{name}"
        if (key == field or (field == "parallel" and key in _LAYOUT_KEYS)) and key not in given \
                and name in defaults and value != defaults[name]:
            text = str(defaults[name]).lower() if isinstance(defaults[name], bool) else str(defaults[name])
            named.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
            passed.append(f"--{options[key]} {text}" if key in options else f"--set {key}={text}")
            sets.append(f"--set {key}={text}")
    if not named:
        return ""
    how = " ".join(passed) + (" / " + " ".join(sets) if passed != sets else "")
    return f"{' and '.join(named)} came from {path} of the resumed run; pass {how} to override"


def _naming_resumed_values(command):
    """A ConfigError on parallel.* of a resumed run says which values came from its config.toml."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ConfigError as e:
            if origin := _resumed_origin(args, e.field):
                e.args = (f"{e.args[0]} ({origin})",)
            raise

    return run


@_naming_resumed_values
def run(args: argparse.Namespace) -> int:
    from ..launch.local import adopt_slurm_environment, in_launched_world, launched_world_size
    from . import rundir
    from .inputs import check_data, check_nproc, print_warnings

    cfg = load_config(args.config, overrides_from(args))
    if args.config is None and (resumed := rundir.resume_defaults(cfg)) is not None:
        # --resume of a run: its own config.toml is the default, the options given now override it
        cfg = load_config(resumed, overrides_from(args), ignore=rundir.NOT_RESUMED)
    check_nproc(args.nproc)
    launching = bool(args.nproc or args.nnodes or args.rdzv_endpoint or args.node_rank is not None)
    if in_launched_world(launching):
        if args.worker or args.node_worker:  # started by our launcher: end with it
            from ..launch.local import die_with_agent

            die_with_agent()
        if args.log_dir:  # started by our launcher: log to the run directory
            from ..launch.local import redirect_worker_output

            redirect_worker_output(Path(args.log_dir))
        lock = None
        if not args.worker:  # torchrun / Slurm / many nodes: the first process of the first attempt claims it
            adopt_slurm_environment()
            cfg, lock = _claim_in_launched_world(cfg, args.overwrite)
        with lock or contextlib.nullcontext():  # rank 0 holds the run directory's lock (rundir.RunLock)
            cfg.validate(launched_world_size())
            stopped = _train(cfg, worker=True)
        if stopped is not None:
            from .preempt import stopped_exit_code

            return stopped_exit_code(stopped)
        return 0
    from ..launch.multinode import launch_nodes, node_options

    nodes = node_options(args)
    if nodes is not None:
        return launch_nodes(cfg, args, nodes, overrides_from(args), check_data)
    cfg = cfg.validate(args.nproc or 1)  # fail before starting any process
    check_data(cfg)
    cfg, lock = rundir.claim(cfg, args.overwrite)
    with lock:  # this process (the launcher of --nproc) holds the run directory for the run's whole life
        print_warnings(cfg)
        if args.nproc:
            return _launch(cfg, args)
        return _train_here(cfg, args.verbose)


def _train_here(cfg, verbose: bool) -> int:
    """Train in this process. A failure that is not the user's reads as a rank's failure under
    --nproc does (launch/local.py): one line naming the error and one naming the log that holds
    its traceback (OUT/logs/rank-0.log), exit code 1; --verbose also shows the traceback here."""
    import sys
    import time
    import traceback

    from .preempt import PREEMPTED_EXIT

    try:
        return 0 if _train(cfg) is None else PREEMPTED_EXIT
    except UserError:
        raise
    except Exception as e:
        text = traceback.format_exc()
        log = Path(cfg.run.out) / "logs" / "rank-0.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(f"==== rank 0 (one process), {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}")
        except OSError:
            log = None
        if verbose or log is None:
            print(text, end="", file=sys.stderr)
        summary = traceback.format_exception_only(e)[-1].strip().splitlines()[0]
        print(f"threefold: failed: {summary}", file=sys.stderr)
        if log is not None:
            print(f"threefold: full log: {log}" + ("" if verbose else " (--verbose shows the traceback here)"),
                  file=sys.stderr)
        return 1


def _launch(cfg, args: argparse.Namespace) -> int:
    from ..launch.local import launch_local

    out = Path(cfg.run.out)
    (out / "config.toml").write_text(cfg.to_toml())
    return launch_local(args.nproc, ["train", "--config", str(out / "config.toml")], args.port,
                        args.max_restarts, out=out, verbose=args.verbose, resume=cfg.checkpoint.resume,
                        peer_copy=cfg.checkpoint.peer_copy)


def _claim_in_launched_world(cfg, overwrite: bool):
    import os

    from ..errors import ConfigError
    from ..observe.faults import first_attempt
    from . import rundir

    if not cfg.run.out:
        raise ConfigError("run.out", "under torchrun or Slurm every process must name the same run directory; "
                          "pass --out")
    if os.environ.get("RANK", "0") == "0" and first_attempt():
        from .inputs import print_warnings
        from ..launch.multinode import print_node_warnings

        print_warnings(cfg)
        print_node_warnings(cfg, int(os.environ.get("LOCAL_WORLD_SIZE") or 0))
        return rundir.claim(cfg, overwrite)  # the others wait for rank 0 in the rendezvous
    if os.environ.get("RANK", "0") == "0":  # rank 0 of a restart: the run directory is this run's again
        return rundir.adopt(cfg), rundir.lock_directory(Path(cfg.run.out))
    return rundir.adopt(cfg), None


def _train(cfg, worker: bool = False):
    """Train; returns the Preempted of a run stopped by a signal (saved at that step), else None."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from .preempt import Preempted, StopSignals
    from .trainer import train

    stop = StopSignals()

    def train_until_stopped(cfg) -> Preempted | None:
        try:
            train(cfg, stop)
        except Preempted as stopped:
            return stopped
        return None

    try:
        with stop.watching():  # SIGTERM, SIGINT, SIGUSR1: save at the next step boundary and stop
            stopped = record(train_until_stopped)(cfg)  # under the elastic agent: writes this rank's error
    except UserError as e:
        _leave_world()
        if worker:
            _exit_with_user_error(e)
        raise
    if worker:  # a finished (or stopped) rank leaves too: the teardown of live communicator threads can abort it
        _leave_world()
    return stopped


def _exit_with_user_error(e: UserError) -> None:
    """A worker of a launched world ends a user error with exit code 2 at once. Its error is
    recorded and it has left the world; the interpreter's teardown can still abort the process
    (a communicator thread destroyed while joinable: "terminate called without an active
    exception"), and a rank that aborts first makes the agent stop the others before they exit
    with 2, so the launcher would report a crash instead of the user's one line."""
    import os
    import sys

    print(e.line(), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def _leave_world() -> None:
    """Every rank meets a user error (a bad checkpoint, bad data), the end of its run or the step a
    stop signal named at the same point, so none is left in a collective: leave the world before
    exiting, rather than have the interpreter's exit tear down live communicator threads (which can
    abort the process - "terminate called without an active exception" - after a finished run, and
    the launcher then reports a crash)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
