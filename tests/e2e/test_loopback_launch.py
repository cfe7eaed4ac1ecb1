"""A one-node `--nproc` launch listens on 127.0.0.1 only (the rendezvous store, the workers'
store and the peer keeper; read from /proc/net/tcp), hands its keeper's secret to the workers
in the environment, not on a command line, and its keeper drops a request without the secret
with one warning line."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.e2e.cli import SRC

RUN = ["train", "--model", "tiny", "--steps", "1000", "--global-batch", "4", "--seq-len", "16", "--data", "stdlib",
       "--no-progress", "--nproc", "2", "--peer-checkpoint", "--save-every", "1", "--set", "run.plot=false",
       # every step of rank 0 takes a second: the launch is still running when it is looked at, and is
       # stopped by the test
       "--set", "fault.kind=slow", "--set", "fault.rank=0", "--set", "fault.step=2", "--set", "fault.delay_s=1"]


def processes_under(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        try:
            parents[int(name)] = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def listening_sockets(pid: int) -> list[str]:
    """host:port of every TCP socket `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                address, _, port = fields[1].rpartition(":")
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.append(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return found


def test_a_one_node_launch_listens_on_loopback_only_and_its_keeper_drops_strangers(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    launcher = subprocess.Popen([sys.executable, "-m", "threefold", *RUN, "--out", str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert launcher.poll() is None and time.monotonic() < deadline, "no step seen"
            time.sleep(0.1)
        tree = processes_under(launcher.pid)
        workers = [pid for pid in tree if b"--worker" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(workers) == 2, tree
        listening = {pid: listening_sockets(pid) for pid in tree}
        # the launcher: the rendezvous store, the workers' store and the keeper; the workers: gloo's
        assert len(listening[launcher.pid]) == 3, listening
        assert all(a.startswith("127.0.0.1:") for a in listening[launcher.pid]), listening
        environ = dict(item.split("=", 1) for item in
                       open(f"/proc/{workers[0]}/environ").read().split("\0") if "=" in item)
        keeper, secret = environ["THREEFOLD_PEER_KEEPER"], environ["THREEFOLD_PEER_SECRET"]
        assert keeper in listening[launcher.pid] and len(secret) == 32
        for pid in tree:
            assert secret.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
        for step in (1, 2):  # anyone's get of rank 0's file: the connection closes, nothing sent but the challenge
            host, _, port = keeper.rpartition(":")
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(json.dumps({"op": "get", "step": step, "name": "rank-00000.safetensors"}).encode() + b"\n")
                nonce, _, rest = b"".join(iter(lambda: s.recv(1 << 16), b"")).partition(b"\n")
                assert set(json.loads(nonce)) == {"nonce"} and rest == b""
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"the keeper at {keeper} dropped a request from 127.0.0.1:" in warnings[0], err
    assert "Traceback" not in err, err
