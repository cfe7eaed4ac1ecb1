"""Many machines: the launcher's node options, the rendezvous endpoint and Slurm's variables.

`threefold train --nnodes N|MIN:MAX --node-rank R --rdzv-endpoint HOST:PORT --nproc P` starts
P processes on this node through torch's elastic agent; the agents of all nodes meet in a c10d
rendezvous whose store the node with `--node-rank 0` hosts at HOST:PORT. Inside a Slurm
allocation with one task per node, the node options come from Slurm's variables when they are
not given. Plain Python (no torch): the launcher checks its input before starting anything.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass

from ..errors import UserError

DEFAULT_PORT = 29500
LOOPBACK = ("127.0.0.1", "localhost")  # the stores bind 127.0.0.1 (rendezvous.py): IPv4 loopback only
AGENT_PID = "THREEFOLD_AGENT_PID"  # set by the launcher for the processes it starts
NODE_RANK = "THREEFOLD_NODE_RANK"  # the --node-rank of the launcher that started this process


@dataclass(frozen=True)
class Nodes:
    """The node part of a launch: how many nodes, which one this is, where they meet."""

    min: int
    max: int
    node_rank: int
    host: str
    port: int
    timeout_s: float = 300.0
    last_call_s: float = 30.0  # MIN:MAX: once MIN nodes are there, how long the rendezvous waits for more

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hosts_rendezvous(self) -> bool:
        """Node rank 0 hosts the rendezvous store (it must run on the endpoint's host)."""
        return self.node_rank == 0

    @property
    def on_loopback(self) -> bool:
        """Every node of this job runs on this machine (tests, trials)."""
        return self.host in LOOPBACK


def parse_nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max); exit 2 with one line on anything else."""
    parts = str(text).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low = high = 0
    if low < 1 or high < 1:
        raise UserError(f"--nnodes: '{text}' is not a node count; give N or MIN:MAX with whole numbers >= 1")
    if low > high:
        raise UserError(f"--nnodes: MIN {low} is larger than MAX {high}; give MIN:MAX with MIN <= MAX")
    return low, high


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep:
        host, port = str(text), str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint: '{text}' is not HOST:PORT; give the first node's host name and a "
                        f"free port, e.g. node001:{DEFAULT_PORT}")
    return host.strip("[]"), int(port)


def nodes_from_options(nnodes: str | None, node_rank: int | None, endpoint: str | None,
                       timeout_s: float | None = None, last_call_s: float | None = None,
                       env=os.environ) -> Nodes | None:
    """The node part of a launch from the options, filled in from Slurm where they are missing;
    None for a single-node launch."""
    if nnodes is None and node_rank is None and endpoint is None:
        slurm = slurm_node_options(env)
        if slurm is None:
            return None
        nnodes, node_rank, endpoint = slurm
    low, high = parse_nnodes(nnodes or "1")
    if high == 1 and endpoint is None:
        if node_rank not in (None, 0):
            raise UserError(f"--node-rank: {node_rank} needs --nnodes 2 or more")
        return None
    if endpoint is None:
        raise UserError("--rdzv-endpoint: a multi-node launch needs HOST:PORT, the first node's host name and a "
                        f"free port (e.g. --rdzv-endpoint node001:{DEFAULT_PORT}); give the same on every node")
    rank = 0 if node_rank is None else int(node_rank)
    if not 0 <= rank < high:
        raise UserError(f"--node-rank: {rank} is outside 0..{high - 1} for --nnodes {nnodes}")
    host, port = parse_endpoint(endpoint)
    for option, value in (("--rdzv-timeout", timeout_s), ("--rdzv-last-call", last_call_s)):
        if value is not None and not 0 < value < float("inf"):  # nan and inf too
            raise UserError(f"{option}: must be a finite number of seconds above 0, got {value}")
    return Nodes(low, high, rank, host, port, 300.0 if timeout_s is None else float(timeout_s),
                 30.0 if last_call_s is None else float(last_call_s))


def wait_for_endpoint(nodes: Nodes, poll_s: float = 0.5) -> None:
    """On a node that does not host the rendezvous: wait (bounded) until the host answers; one
    line and exit 2 when it never does."""
    if nodes.hosts_rendezvous:
        return
    deadline = time.monotonic() + nodes.timeout_s
    while True:
        try:
            with socket.create_connection((nodes.host, nodes.port), timeout=min(5.0, nodes.timeout_s)):
                return
        except OSError as e:
            if time.monotonic() + poll_s >= deadline:
                raise UserError(f"--rdzv-endpoint: nothing answers at {nodes.endpoint} after {nodes.timeout_s:.0f} s "
                                f"({e.strerror or e}); start the launcher with --node-rank 0 on {nodes.host} "
                                "(or check the host name and port; --rdzv-timeout sets the wait)") from None
            time.sleep(poll_s)


def tp_across_nodes(tp: int, per_node: int) -> str | None:
    """A warning when tensor-parallel groups (consecutive ranks) cross a node boundary."""
    if per_node < 1 or tp <= 1 or per_node % tp == 0:
        return None
    return (f"tp={tp} does not divide the {per_node} processes per node, so tensor-parallel groups span "
            "nodes and every layer's collectives cross the network; use a tp that divides the processes per node")


# ---------------------------------------------------------------- Slurm

def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list (`node[003-005,9],gpu1` -> `node003`)."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not match:
        raise UserError(f"SLURM_JOB_NODELIST: cannot read '{nodelist}'; pass --rdzv-endpoint HOST:PORT")
    return match.group(1) + (match.group(2) or "")


def tasks_per_node(env=os.environ) -> int | None:
    """Slurm's tasks per node (`SLURM_NTASKS_PER_NODE`, or the first count of `SLURM_TASKS_PER_NODE`, e.g. `4(x2)`)."""
    text = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    match = re.match(r"\d+", text or "")
    return int(match.group()) if match else None


def slurm_node_options(env=os.environ) -> tuple[str, int, str] | None:
    """(nnodes, node rank, endpoint) inside a Slurm step with one task per node and several nodes."""
    nnodes, ntasks = int(env.get("SLURM_NNODES") or 1), int(env.get("SLURM_NTASKS") or 1)
    if nnodes <= 1 or ntasks != nnodes or "SLURM_NODEID" not in env:
        return None
    host = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT)
    return str(nnodes), int(env["SLURM_NODEID"]), f"{host}:{port}"


def adopt_slurm_tasks(env=os.environ) -> None:
    """One Slurm task per process (srun without a launcher): map Slurm's variables to
    torch.distributed's. MASTER_ADDR defaults to the first host of the allocation."""
    if "RANK" in env or int(env.get("SLURM_NTASKS") or 1) <= 1:
        return
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_slurm_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               GROUP_RANK=env.get("SLURM_NODEID", "0"))
    per_node = tasks_per_node(env)
    if per_node:
        env.setdefault("LOCAL_WORLD_SIZE", str(per_node))
    env.setdefault("MASTER_PORT", str(DEFAULT_PORT))
