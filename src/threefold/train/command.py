"""`threefold train`: options of the interface contract mapped onto config keys."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from ..config import load_config
from ..launch import adopt_slurm_environment, in_launched_world, launch_local, launched_world_size

# option -> config key; every value goes through the config parser, so errors name the key.
OPTION_KEYS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "zero": "parallel.zero",
    "model": "model.preset", "schedule": "pipeline.schedule", "microbatches": "train.microbatches",
    "virtual_stages": "pipeline.virtual_stages", "precision": "precision.compute",
    "activation_checkpointing": "remat.policy", "compress": "compress.method", "steps": "train.steps",
    "global_batch": "train.global_batch", "seq_len": "train.seq_len", "lr": "train.lr", "seed": "train.seed",
    "data": "data.source", "out": "run.out", "save_every": "checkpoint.save_every", "resume": "checkpoint.resume",
}
FLAG_KEYS = {"async_save": "checkpoint.async_save", "deterministic": "train.deterministic"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with any config key; the options below override it")
    p.add_argument("--nproc", type=int, help="local processes to start (ignored inside a launched world)")
    p.add_argument("--port", type=int, help="rendezvous port for --nproc (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the local world after a failure")
    for option, key in OPTION_KEYS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, metavar="V", help=f"sets {key}")
    for option, key in FLAG_KEYS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, action="store_true", help=f"sets {key}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, repeatable, e.g. --set model.layers=4")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def overrides_from(args: argparse.Namespace) -> list[str]:
    out = [f"{key}={getattr(args, option)}" for option, key in OPTION_KEYS.items()
           if getattr(args, option) is not None]
    out += [f"{key}=true" for option, key in FLAG_KEYS.items() if getattr(args, option)]
    if args.no_progress:
        out.append("run.progress=false")
    return out + list(args.overrides)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, overrides_from(args))
    if args.nproc and not in_launched_world():
        cfg = cfg.validate(args.nproc)  # fail before starting any process
        out = Path(cfg.run.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())
        return launch_local(args.nproc, ["train", "--config", str(out / "config.toml")], args.port,
                            args.max_restarts, hang_report=out / "flight" / "hang-report.txt")
    adopt_slurm_environment()
    cfg.validate(launched_world_size())
    _train(cfg)
    return 0


@record  # under the elastic agent: writes this rank's error for the launcher to report
def _train(cfg) -> None:
    from .trainer import train

    train(cfg)
