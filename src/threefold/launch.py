"""Starting processes: PyTorch's elastic launcher for local worlds, or joining an existing one.

threefold never writes its own launcher: `--nproc N` hands the job to torch's elastic agent
(the engine behind torchrun), which starts N copies of `python -m threefold ...`, watches
them, and stops the others when one fails. Under torchrun or Slurm the process joins the
world the launcher already describes.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from pathlib import Path

from .errors import UserError


def in_launched_world() -> bool:
    """True under torchrun / the elastic agent, or Slurm with several tasks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1


def adopt_slurm_environment() -> None:
    """Map Slurm's task variables to torch.distributed's (MASTER_ADDR must come from the job script)."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    if "MASTER_ADDR" not in os.environ:
        raise UserError("under Slurm, export MASTER_ADDR (the first node's host name) and MASTER_PORT in the job script")
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    os.environ.setdefault("MASTER_PORT", "29500")


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def check_port(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UserError(f"--port: port {port} is already in use; pick another or omit --port to use a free one") \
                from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nproc: int, argv: list[str], port: int | None = None, max_restarts: int = 0,
                 hang_report: Path | None = None) -> int:
    """Run `python -m threefold *argv` on `nproc` local processes; returns the exit code.

    A failing worker makes the agent stop the others; its rank and error are printed on one line
    each. A worker that exited with 2 (a user error found late, e.g. in the data) gives 2.
    When the hang watchdog stopped the world, its report (`hang_report`, written during this
    launch) follows.
    """
    started = time.time()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if port is None:
        port = free_port()
    else:
        check_port(port)
    if max_restarts > 0:
        # The agent's shared TCPStore outlives a restart with the dead workers' gloo addresses in
        # it, and restarted workers intermittently connect to those (refused, then a hang until
        # the timeout). Without sharing, rank 0 of every attempt hosts a fresh store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{port}", run_id=f"threefold-{uuid.uuid4().hex[:8]}",
                          max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "threefold", *argv)
    except ChildFailedError as e:
        failures = sorted(e.failures.items(), key=lambda item: item[1].timestamp)
        first_rank, first = failures[0]
        print(f"threefold: rank {first_rank} failed (exit code {first.exitcode}): {_last_line(first.message)}",
              file=sys.stderr)
        if len(failures) > 1:
            others = ", ".join(str(rank) for rank, _ in failures[1:])
            print(f"threefold: ranks {others} were stopped after rank {first_rank} failed", file=sys.stderr)
        if hang_report is not None and hang_report.exists() and hang_report.stat().st_mtime >= started - 1:
            print(hang_report.read_text().rstrip(), file=sys.stderr)
        return 2 if first.exitcode == 2 else 1
    return 0


def _last_line(message) -> str:
    """The error line of a failure record (the agent stores a dict or a plain string)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error message (see the rank's output above)"
