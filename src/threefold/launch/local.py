"""Starting processes: PyTorch's elastic launcher for local worlds, or joining an existing one.

threefold never writes its own launcher: `--nproc N` hands the job to torch's elastic agent
(the engine behind torchrun), which starts N copies of `python -m threefold ...`, watches
them, and stops the others when one fails. Under torchrun or Slurm the process joins the
world the launcher already describes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from ..errors import UserError
from .nodes import AGENT_PID, NODE_RANK, Nodes, wait_for_endpoint


def die_with_agent() -> None:
    """In a worker of `launch_local`: ask the kernel to SIGKILL this process when its launcher
    (the elastic agent, its parent) goes away, so a lost launcher never leaves workers behind
    holding a node's share of the world. Linux only; elsewhere a no-op."""
    agent = os.environ.get(AGENT_PID)
    if agent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(agent):  # the launcher ended before the request took effect
        os._exit(1)


def in_launched_world(launching: bool = False) -> bool:
    """True under torchrun / the elastic agent, or Slurm with one task per process.

    `launching`: the command asked to start processes itself (--nproc / --nnodes), so a Slurm
    step of one task per node runs the launcher rather than being the world.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return not launching and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def adopt_slurm_environment() -> None:
    """Map Slurm's task variables to torch.distributed's (nodes.adopt_slurm_tasks)."""
    from .nodes import adopt_slurm_tasks

    adopt_slurm_tasks()


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
                 hang_report: Path | None = None, out: Path | None = None, verbose: bool = False,
                 resume: str = "none", nodes: Nodes | None = None, peer_copy: bool = False) -> int:
    """Run `python -m threefold *argv` on `nproc` local processes; returns the exit code.

    With `nodes`, this node's agent joins the agents of the other nodes in a c10d rendezvous
    at `nodes.endpoint` (hosted by node rank 0) and the world spans them all; every node's
    launcher returns 0 when the job finished.

    With `out` (the run directory) and not `verbose`, each worker's output goes to
    `out/logs/rank-N.log` and the terminal shows threefold's own lines: the progress bar and
    messages of rank 0, a restart line per restart, and, when the job fails, the failing rank
    and its error on one line and where its log is. A worker that exited with 2 (a user error
    found late, e.g. in a checkpoint) gives 2 and the error's one line. When the hang watchdog
    stopped the world, its report (`hang_report`, written during this launch) follows.

    With `peer_copy`, this launcher holds in memory the checkpoint files its workers and a peer
    node's workers send it (checkpoint/peer.py: a keeper thread, gone with this process), and
    tells its workers where (`THREEFOLD_PEER_KEEPER`).

    SIGTERM, SIGINT and SIGUSR1 go on to the workers, which save at the next step boundary and
    stop; then (or when the workers were signalled directly) this returns 3, PREEMPTED_EXIT, and
    restarts nothing. A second SIGINT ends the workers and this process at once (signals.py).
    """
    started = time.time()
    if nodes is not None and not verbose:
        _quiet_store_warnings()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .signals import NOTE_ENV, PREEMPTED_EXIT, Forwarder, StopNote

    port = _rendezvous_port(nodes, port)
    if out is not None and hang_report is None:
        hang_report = out / "flight" / "hang-report.txt"
    log_dir = out / "logs" if out is not None and not verbose else None
    if argv[:1] == ["train"]:
        argv = [*argv, "--worker" if nodes is None else "--node-worker"] + \
            (["--log-dir", str(log_dir)] if log_dir is not None else [])
    os.environ[AGENT_PID] = str(os.getpid())  # the workers end when this process does (die_with_agent)
    if nodes is not None:
        os.environ[NODE_RANK] = str(nodes.node_rank)
    if max_restarts > 0 or nodes is not None:
        # The agent's shared TCPStore outlives a restart with the dead workers' gloo addresses in
        # it, and restarted workers intermittently connect to those (refused, then a hang until
        # the timeout). Without sharing, rank 0 of every attempt hosts a fresh store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend=_one_node_rendezvous(),
                          rdzv_endpoint=f"127.0.0.1:{port}", run_id=f"threefold-{uuid.uuid4().hex[:8]}",
                          max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
                          # SIGTERM and SIGINT are threefold's (Forwarder), not the agent's: it stops workers at once
                          signals_to_handle="SIGHUP,SIGQUIT", local_addr="127.0.0.1")
    if nodes is not None:
        config = _node_config(config, nodes)
    watcher = _AgentWatcher(max_restarts, log_dir, out, resume, quiet=not verbose)
    note = StopNote()
    os.environ[NOTE_ENV] = str(note.path)
    keeper = _start_keeper(nodes, nproc) if peer_copy else None
    try:
        with watcher, Forwarder().watching():
            elastic_launch(config, entrypoint=sys.executable)("-m", "threefold", *argv)
    except RendezvousError as e:
        if nodes is None:
            raise
        print(f"threefold: error: {_rendezvous_line(e, nodes)}", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        return _report_failure(e, log_dir, hang_report, started)
    finally:
        if keeper is not None:
            keeper.close()
        stopped = note.stopped()
        note.close()
    return PREEMPTED_EXIT if stopped else 0  # the workers stopped on a signal and saved



def _rendezvous_port(nodes: Nodes | None, port: int | None) -> int:
    """The port of the rendezvous: the nodes' endpoint (checked free where this node hosts it on loopback,
    waited for where another node does), the one asked for (checked free), or 0."""
    if nodes is not None:
        if nodes.hosts_rendezvous and nodes.on_loopback:
            check_port(nodes.port)
        wait_for_endpoint(nodes)
        return nodes.port
    if port is None:
        return 0  # the launcher's loopback store binds a free port itself (rendezvous.py): no window to lose it in
    check_port(port)
    return port


def _report_failure(e, log_dir: Path | None, hang_report: Path | None, started: float) -> int:
    """A failed launch (`ChildFailedError` e) in threefold's lines: a user error's one line and 2, or the
    first failing rank, its error, the ranks stopped after it, its log and a fresh hang report, and 1."""
    failures = sorted(e.failures.items(), key=lambda item: item[1].timestamp)
    first_rank, first = failures[0]
    user = [f for _, f in failures if f.exitcode == 2]
    if user:  # a user error (every rank meets it; one that then died on its way out does not hide it)
        print(f"threefold: error: {_user_message(user[0].message)}", file=sys.stderr)
        return 2
    print(f"threefold: rank {first_rank} failed ({_exit_text(first.exitcode)}): "
          f"{_error_line(first.message, log_dir, first_rank)}", file=sys.stderr)
    if len(failures) > 1:
        others = ", ".join(str(rank) for rank, _ in failures[1:])
        print(f"threefold: ranks {others} were stopped after rank {first_rank} failed", file=sys.stderr)
    if log_dir is not None:
        print(f"threefold: full log: {log_dir / f'rank-{first_rank}.log'} (--verbose shows every rank here)",
              file=sys.stderr)
    if hang_report is not None and hang_report.exists() and hang_report.stat().st_mtime >= started - 1:
        print(hang_report.read_text().rstrip(), file=sys.stderr)
    return 1

def _quiet_store_warnings() -> None:
    """In the launcher of a node of a multi-node job, before torch is loaded: torch's C++ warnings
    stay off the terminal. Nodes end at different moments, and a node whose agent still talks to
    the rendezvous store when node rank 0's launcher has gone (a clean finish or a stop signal)
    gets a TCPStore warning with some 20 lines of C++ frames; what went wrong, if anything,
    still reaches the terminal as threefold's lines. The level is read when torch loads, so the
    workers, started later, get the user's setting back."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return  # too late to change, or the user's choice
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401  (reads the level)
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _one_node_rendezvous() -> str:
    """torch's c10d rendezvous with its stores on 127.0.0.1 only (rendezvous.py): one node, or
    nodes that are all on this machine."""
    from .rendezvous import register

    return register()


def _start_keeper(nodes: Nodes | None, nproc: int):
    """The peer keeper: on loopback for a job of one node, holding the files of this node's
    processes and (several nodes) its ring peer's; its address and secret go to the workers in
    the environment."""
    from ..checkpoint.peer import start_keeper

    one_node = nodes is None or nodes.max == 1
    keeper = start_keeper(one_node or nodes.on_loopback, nproc if one_node else 2 * nproc)
    os.environ.update(keeper.environment())
    return keeper


def _node_config(config, nodes: Nodes):
    """The launch config of one node of a multi-node job: the same run id and endpoint on every
    node; node rank 0 hosts the rendezvous store, the others connect to it."""
    import dataclasses

    wait = max(1, int(nodes.timeout_s))
    return dataclasses.replace(  # every node on this machine: the stores on 127.0.0.1 only (rendezvous.py)
        config, min_nodes=nodes.min, max_nodes=nodes.max,
        rdzv_backend=_one_node_rendezvous() if nodes.on_loopback else "c10d", rdzv_endpoint=nodes.endpoint,
        run_id=f"threefold-{nodes.port}",
        rdzv_configs={"is_host": nodes.hosts_rendezvous, "join_timeout": wait, "read_timeout": wait, "timeout": wait,
                      "last_call_timeout": 1 if nodes.min == nodes.max else max(1, round(nodes.last_call_s)),
                      # a lost node leaves the rendezvous when its heartbeats stop: after 3 x 5 s, or
                      # 5 x 1 s when every node is on this machine (trials, tests)
                      "keep_alive_interval": 1 if nodes.on_loopback else 5,
                      "keep_alive_max_attempt": 5 if nodes.on_loopback else 3},
        local_addr="127.0.0.1" if nodes.on_loopback else None)


def _rendezvous_line(error: Exception, nodes: Nodes) -> str:
    if nodes.hosts_rendezvous and "store" in str(error).lower():
        return (f"--rdzv-endpoint: this node (--node-rank 0) cannot host the rendezvous at {nodes.endpoint}; run "
                f"node rank 0 on {nodes.host} with a free port")
    return (f"--nnodes: the rendezvous at {nodes.endpoint} did not complete within {nodes.timeout_s:.0f} s "
            f"({type(error).__name__}); start every node's launcher with the same --nnodes and --rdzv-endpoint")


def _exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _error_line(message, log_dir: Path | None, rank: int) -> str:
    """The error line of a failure record (the agent stores a dict or a plain string), else the
    last line of the rank's log."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    if lines and not lines[-1].startswith("Signal ") and "To enable traceback" not in lines[-1]:
        return lines[-1]
    if log_dir is not None:
        last = _last_log_line(log_dir / f"rank-{rank}.log")
        if last:
            return last
    return lines[-1] if lines else "no error message"


def _user_message(message) -> str:
    """A UserError's text without its class name (`CheckpointError: x` -> `x`)."""
    line = _error_line(message, None, 0)
    name, sep, rest = line.partition(": ")
    return rest if sep and name.isidentifier() and name.endswith("Error") else line


def _last_log_line(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class _AgentWatcher(logging.Handler):
    """Reads the elastic agent's log records during a launch: turns a restart into one threefold
    line, and (unless verbose) keeps the agent's own messages off the terminal."""

    LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
    AGENT = "torch.distributed.elastic.agent.server.api"

    def __init__(self, max_restarts: int, log_dir: Path | None, out: Path | None, resume: str, quiet: bool):
        super().__init__(logging.INFO)
        self.max_restarts, self.log_dir, self.out, self.resume, self.quiet = max_restarts, log_dir, out, resume, quiet
        self.failure: tuple[int, int] | None = None  # (exit code, local rank) of the attempt's first failure
        self.global_ranks: dict[int, int] = {}  # local rank -> global rank, this attempt's
        self._saved: list = []

    def __enter__(self):
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate))
            logger.addHandler(self)
            logger.propagate = not self.quiet
        agent = logging.getLogger(self.AGENT)
        self._saved.append((agent, agent.level))
        agent.setLevel(min(agent.getEffectiveLevel(), logging.INFO))  # the restart record is INFO
        return self

    def __exit__(self, *exc):
        (agent, level), saved = self._saved[-1], self._saved[:-1]
        agent.setLevel(level)
        for logger, propagate in saved:
            logger.removeHandler(self)
            logger.propagate = propagate
        return False

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if "Rendezvous complete for workers" in text and isinstance(record.args, dict):
            self.global_ranks = dict(zip(record.args.get("local_ranks", ()), record.args.get("global_ranks", ())))
        elif text.startswith("failed (exitcode") and record.args:
            self.failure = (int(record.args[0]), int(record.args[1]))
        elif "will restart worker group" in text and "attempts left" in text and record.args:
            left = int(record.args[2])
            attempt = self.max_restarts - left + 2
            who = "a rank failed"
            if self.failure is not None:
                code, local = self.failure
                rank = self.global_ranks.get(local, local)  # a node's local rank 0 is global rank N x nproc
                line = _last_log_line(self.log_dir / f"rank-{rank}.log") if self.log_dir and code > 0 else ""
                who = f"rank {rank} failed ({_exit_text(code)}{': ' + line if line else ''})"
            print(f"threefold: {who}; restarting (attempt {attempt} of {self.max_restarts + 1}) from "
                  f"{self._restart_point()}", file=sys.stderr, flush=True)
            self.failure = None

    def _restart_point(self) -> str:
        if self.resume != "auto" or self.out is None:
            return "the start" if self.resume == "none" else self.resume
        from ..checkpoint.writer import complete_checkpoints

        found = complete_checkpoints(self.out / "checkpoints")
        return found[-1].name if found else "the start (no checkpoint yet)"


def redirect_worker_output(log_dir: Path) -> None:
    """In a worker started by `launch_local`: everything the process writes (Python and C++)
    goes to `log_dir/rank-N.log`; threefold's own lines of rank 0 and its progress bar also
    reach the terminal. Each attempt appends under a header."""
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
    log_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(log_dir / f"rank-{rank}.log", "a", buffering=1)
    log.write(f"==== rank {rank}, attempt {attempt}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stderr = _Console(sys.stderr, terminal if rank == 0 else None)


class _Console:
    """sys.stderr of a worker: everything to the log; threefold's lines and the progress bar
    (writes starting with `threefold:` or a carriage return) also to the terminal."""

    def __init__(self, log, terminal):
        self._log, self._terminal, self._forwarding = log, terminal, False

    def write(self, text: str) -> int:
        self._log.write(text)
        if self._terminal is not None:
            if text.startswith(("threefold:", "\r")) and not text.startswith("threefold: error:"):
                self._forwarding = True
            elif not (self._forwarding and text.strip() == ""):
                self._forwarding = False
            if self._forwarding:
                self._terminal.write(text)
                self._terminal.flush()
        return len(text)

    def flush(self) -> None:
        self._log.flush()
        if self._terminal is not None:
            self._terminal.flush()

    def fileno(self) -> int:  # the terminal's size is what a progress bar asks for
        return (self._terminal or self._log).fileno()

    def isatty(self) -> bool:
        return self._terminal is not None and self._terminal.isatty()

    def __getattr__(self, name):
        return getattr(self._log, name)
