"""Nodes of a multi-node job on one machine (a loopback `--rdzv-endpoint`): the rendezvous store
and the workers' store listen on 127.0.0.1 only (read from /proc/net/tcp); a node's restart
line names the failing process by its global rank and reads that rank's log; a node's launcher
keeps torch's C++ store warnings (a warning and ~20 lines of C++ frames when the store's host
has gone) off the terminal, and its workers get the user's setting."""

import logging
import os
import subprocess
import sys
import threading

from tests.e2e.cli import SRC
from tests.unit.test_peer_keeper import listening_on

AGENT = "torch.distributed.elastic.agent.server.api"


def test_two_nodes_of_this_machine_meet_on_loopback_only(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from threefold.launch import rendezvous
    from threefold.launch.local import free_port

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # restored after the test
    port = free_port()

    def node(is_host: bool):
        return get_rendezvous_handler(RendezvousParameters(
            backend=rendezvous.register(), endpoint=f"127.0.0.1:{port}", run_id="two", min_nodes=2, max_nodes=2,
            local_addr="127.0.0.1", is_host=is_host, join_timeout=60, last_call_timeout=1, read_timeout=60))

    host = node(True)
    other = node(False)  # a client of node rank 0's store
    infos = {}
    try:
        threads = [threading.Thread(target=lambda h=h, name=name: infos.update({name: h.next_rendezvous()}))
                   for name, h in (("host", host), ("other", other))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert sorted(infos) == ["host", "other"], infos
        assert listening_on(port) == {"127.0.0.1"}, "the rendezvous store"
        stores = {info.bootstrap_store_info.master_port for info in infos.values()}
        assert len(stores) == 1 and {info.bootstrap_store_info.master_addr for info in infos.values()} == {"127.0.0.1"}
        assert listening_on(stores.pop()) == {"127.0.0.1"}, "the workers' store, one for both nodes"
        assert sorted(info.rank for info in infos.values()) == [0, 1]
        hosting = [h.worker_store is not None for h in (host, other)]  # only the launcher of the round's rank 0
        assert hosting == [infos["host"].rank == 0, infos["other"].rank == 0], hosting
        assert host.use_agent_store and other.use_agent_store  # the workers connect to it, host none
    finally:
        other.shutdown()
        host.shutdown()


def test_a_node_launch_on_loopback_takes_the_loopback_rendezvous(monkeypatch):
    import torch.distributed.launcher.api as launcher

    from threefold.launch.local import free_port, launch_local
    from threefold.launch.nodes import Nodes

    seen = []

    def elastic_launch(config, entrypoint):
        def run(*args):
            seen.append((config, dict(os.environ)))
        return run

    monkeypatch.setattr(launcher, "elastic_launch", elastic_launch)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert launch_local(2, ["train"], nodes=Nodes(2, 2, 0, "127.0.0.1", free_port())) == 0
    assert launch_local(2, ["train"], nodes=Nodes(2, 2, 0, "node001.cluster", 29400)) == 0
    (here, env), (cluster, _) = seen
    assert (here.rdzv_backend, here.local_addr) == ("threefold-loopback", "127.0.0.1")
    assert here.rdzv_configs["is_host"] is True
    assert (cluster.rdzv_backend, cluster.local_addr) == ("c10d", None)
    assert "TORCH_CPP_LOG_LEVEL" not in env  # the workers log as the user asked


def test_a_restart_line_names_the_global_rank_and_reads_its_log(tmp_path, capsys):
    from threefold.launch.local import _AgentWatcher

    (tmp_path / "rank-2.log").write_text("==== rank 2, attempt 1\nRuntimeError: the second node's first\n")
    (tmp_path / "rank-0.log").write_text("==== rank 0, attempt 1\nnot this one\n")
    agent, procs = logging.getLogger(AGENT), logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    with _AgentWatcher(1, tmp_path, None, "none", quiet=True):  # torch's own records, as node 1's agent logs them
        agent.info("[%(role)s] Rendezvous complete for workers. Result:\n  local_ranks=%(local_ranks)s\n"
                   "  global_ranks=%(global_ranks)s\n", {"role": "default", "local_ranks": [0, 1],
                                                         "global_ranks": [2, 3]})
        procs.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 1234, sys.executable)
        agent.info("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default", "FAILED", 1, 1)
    assert capsys.readouterr().err.splitlines() == [
        "threefold: rank 2 failed (exit code 1: RuntimeError: the second node's first); restarting (attempt 2 of "
        "2) from the start"]


STORE_GONE = """
import subprocess, sys
from threefold.launch import local
local._quiet_store_warnings()  # as a node's launcher does before loading torch
import datetime, os
from torch.distributed import TCPStore
host = subprocess.Popen([sys.executable, "-c", "import sys; from torch.distributed import TCPStore; "
                         "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); print(s.port); "
                         "sys.stdout.flush(); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
client = TCPStore("127.0.0.1", int(host.stdout.readline()), is_master=False, timeout=datetime.timedelta(seconds=30))
client.set("a", "1")
host.stdin.close()
host.wait()  # the store's host has gone
try:
    client.get("a")
except Exception as e:
    print("the client saw:", type(e).__name__, file=sys.stderr)
print("TORCH_CPP_LOG_LEVEL" in os.environ)
"""


def test_a_node_launcher_keeps_torchs_store_warnings_off_the_terminal():
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", STORE_GONE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # the environment the workers would get is the user's again
    lines = done.stderr.strip().splitlines()
    assert lines == ["the client saw: DistNetworkError"], done.stderr
