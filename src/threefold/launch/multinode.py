"""`threefold train --nnodes ...`: one node's share of a multi-node job.

Every node runs the same command with its own `--node-rank`; this launcher checks the input,
then hands `--nproc` processes to torch's elastic agent (launch.launch_local with nodes). The
run directory is claimed by global rank 0 once the world exists (which node holds it is
decided by the rendezvous), exactly as under torchrun, so `--out` is required.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from ..config import Config
from ..config.elastic import check_node_counts
from ..errors import ConfigError
from .nodes import Nodes, nodes_from_options, tp_across_nodes


def node_options(args: argparse.Namespace) -> Nodes | None:
    return nodes_from_options(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_timeout, args.rdzv_last_call)


def worker_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The workers' `train` arguments: the same config file and overrides as this command."""
    argv = ["train"]
    if args.config:
        argv += ["--config", str(Path(args.config).resolve())]
    for item in overrides:
        argv += ["--set", item]
    return argv + (["--overwrite"] if args.overwrite else [])


def print_node_warnings(cfg, per_node: int) -> None:
    text = tp_across_nodes(cfg.parallel.tp, per_node)
    if text:
        print(f"threefold: warning: {text}", file=sys.stderr, flush=True)


def launch_nodes(cfg, args: argparse.Namespace, nodes: Nodes, overrides: list[str],
                 check_data: Callable[[Config], None]) -> int:
    """Start this node's share of the job: `cfg` is validated for the largest world and its data checked
    (`check_data`, handed in by `threefold train`: train/inputs.py) before any process starts."""
    from .local import launch_local

    nproc = args.nproc or 1
    argv = worker_argv(args, overrides)
    if nodes.min < nodes.max:  # elastic: the layout is written for MAX nodes and re-derived for fewer
        check_elastic(cfg, args.max_restarts)
        cfg = check_node_counts(cfg, nodes.min, nodes.max, nproc, Config.validate)
        argv += ["--set", f"parallel.elastic_world={nproc * nodes.max}"]
    cfg = cfg.validate(nproc * nodes.max)  # fail before starting any process
    check_data(cfg)
    if not cfg.run.out:
        raise ConfigError("run.out", "a multi-node job needs --out, the same run directory on every node "
                          "(a shared file system keeps checkpoints in one place)")
    return launch_local(nproc, argv, None, args.max_restarts, out=Path(cfg.run.out),
                        verbose=args.verbose, resume=cfg.checkpoint.resume, nodes=nodes,
                        peer_copy=cfg.checkpoint.peer_copy)


def check_elastic(cfg, max_restarts: int) -> None:
    """A job that continues on fewer nodes continues from its newest checkpoint."""
    ck = cfg.checkpoint
    if ck.resume != "auto" or ck.save_every != "auto" and ck.save_every < 1:
        raise ConfigError("checkpoint", "--nnodes MIN:MAX continues on the nodes left from the newest checkpoint: "
                          "pass --resume auto and --save-every N (or auto)")
    if max_restarts < 1:
        raise ConfigError("--max-restarts", "--nnodes MIN:MAX restarts the job when a node is lost: pass "
                          "--max-restarts K with K >= 1 (each lost node uses one)")
