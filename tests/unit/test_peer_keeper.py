"""The peer keeper (checkpoint/peer.py) lets no one in and holds only what the job writes: a
request without the keeper's secret, a captured request sent again, a put over its bounds, a
claimed length of 10^12 bytes and a keeper that never answers each cost at most one warning
line, and the bytes it holds stay bounded; idle or slow connections do not keep the job's own
requests out. A launch of one node puts its rendezvous stores and its keeper on 127.0.0.1 only."""

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import tracemalloc

import pytest

from threefold.checkpoint import peer, peer_wire

NAME = "rank-00000.safetensors"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def challenge(sock: socket.socket) -> str:
    """The nonce line a keeper sends first on every connection, read byte by byte (nothing after it)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        assert byte, f"closed after {line!r}"
        line += byte
    return json.loads(line)["nonce"]


def raw(address: str, header: dict | bytes, payload: bytes = b"", timeout_s: float = 10.0,
        secret: str | None = None) -> bytes:
    """Send one request line (and payload) as anyone could, signed for this connection with
    `secret` if one is given; everything the keeper answers after its challenge."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        nonce = challenge(sock)
        if secret is not None:
            header = peer_wire.signed(secret, header, nonce)
        line = header if isinstance(header, bytes) else json.dumps(header).encode()
        try:
            sock.sendall(line + b"\n")
            for start in range(0, len(payload), 1 << 20):
                sock.sendall(payload[start:start + (1 << 20)])
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the keeper closed the connection
            pass
        answer = b""
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except OSError:
            pass
        return answer


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "warning" in line]


@pytest.fixture
def keeper():
    k = peer.Keeper(max_files=2, max_bytes=50_000, timeout_s=2.0)
    yield k
    k.close()


def test_a_request_without_the_secret_is_dropped_with_one_warning(keeper, capfd):
    data = os.urandom(1000)
    peer.put(keeper.address, keeper.secret, 2, NAME, sha(data), data)
    get = {"op": "get", "step": 2, "name": NAME}
    assert raw(keeper.address, get, secret=keeper.secret).endswith(data)  # the job's own request
    assert raw(keeper.address, get) == b""  # no MAC: nothing of rank 0's bytes
    assert raw(keeper.address, get, secret="0" * 32) == b""  # another secret
    assert raw(keeper.address, {"op": "list", "step": 2, "mac": "f" * 64}) == b""
    assert raw(keeper.address, b"[" * 30_000 + b"]" * 30_000) == b""  # too deep to parse
    for step in range(5):  # 5 x 100 MB claimed (1 MB sent each): never read, never held
        put = {"op": "put", "step": 10**9 + step, "name": NAME, "sha256": "0" * 64, "bytes": 100 << 20}
        raw(keeper.address, put, os.urandom(1 << 20))
    raw(keeper.address, {"op": "put", "step": 3, "name": NAME, "sha256": "0" * 64, "bytes": 10**12}, b"x" * 100)
    with pytest.raises(OSError):  # a client with another secret: dropped too (closed, no answer)
        peer.put(keeper.address, "0" * 32, 2, NAME, sha(data), data)
    assert keeper.dropped == 11 and keeper.reserved == 0
    assert keeper.held_bytes() == 1000 and set(keeper.files) == {2}, "the job's copy is still there, alone"
    err = capfd.readouterr().err
    assert len(warnings(err)) == 1 and "Traceback" not in err, err
    assert warnings(err)[0].startswith(f"threefold: warning: checkpoint.peer_copy: the keeper at {keeper.address} "
                                       "dropped a request from 127.0.0.1:"), err


def test_a_captured_request_sent_again_is_dropped(keeper, monkeypatch, capfd):
    data = os.urandom(1000)
    sent = []
    send = peer_wire.send
    monkeypatch.setattr(peer_wire, "send", lambda sock, header, payload=b"": (sent.append((header, bytes(payload))),
                                                                            send(sock, header, payload))[1])
    peer.put(keeper.address, keeper.secret, 2, NAME, sha(data), data)
    assert peer.get(keeper.address, keeper.secret, 2, NAME, 1000) == data
    monkeypatch.undo()
    (put, payload), (get, _) = sent  # what a listener on the wire saw, MAC and all
    assert put["op"] == "put" and payload == data and get["op"] == "get"
    assert raw(keeper.address, json.dumps(get).encode()) == b"", "a replayed get: none of the bytes"
    keeper.files.clear()
    assert raw(keeper.address, json.dumps(put).encode(), payload) == b"" and keeper.files == {}, "a replayed put"
    assert keeper.dropped == 2 and keeper.refused == 0
    err = capfd.readouterr().err
    assert len(warnings(err)) == 1 and "signed for another connection (a replay)" in err, err
    peer.put(keeper.address, keeper.secret, 2, NAME, sha(data), data)  # the job's own requests still pass
    assert peer.get(keeper.address, keeper.secret, 2, NAME, 1000) == data


def test_idle_connections_do_not_keep_the_job_out():
    """Twice as many idle connections as the keeper serves at once, all at the same moment, then the
    job's own request: each newcomer takes the place of the oldest connection without a valid
    request (which sees its connection closed), so every idle one got its challenge, the job's
    request is answered, and the 4 newest idle connections are left open. Every wait is bounded."""
    keeper = peer.Keeper(max_connections=4, timeout_s=60.0)  # idle ones would hold a place for a minute
    idle = [socket.create_connection(keeper.address.rsplit(":", 1), timeout=10) for _ in range(8)]
    try:
        for sock in idle:
            challenge(sock)  # each had a place (the newer four took the older four's)
        assert peer.listing(keeper.address, keeper.secret, 2, timeout_s=10) == {}  # the job's: served
        closed = []
        for sock in idle:
            sock.setblocking(False)
            try:
                closed.append(sock.recv(1) == b"")
            except BlockingIOError:  # open, nothing more sent to it
                closed.append(False)
        assert sum(closed) == 5 and keeper.dropped == 5, closed  # 4 made way for idle ones, 1 for the job's
        # the job's own connection leaves the set once its reply is sent: the keeper's thread may not have
        # removed it yet when the client has read the reply (a bounded wait, not a time bound)
        deadline = time.monotonic() + 10
        while len(keeper.holding) > 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(keeper.holding) == 3
    finally:
        for sock in idle:
            sock.close()
        keeper.close()


def test_a_request_line_that_trickles_in_is_dropped_at_its_deadline():
    """A byte every 50 ms never trips the 60 s silence timeout; the line's deadline (1 s) ends it."""
    keeper = peer.Keeper(timeout_s=60.0, request_deadline_s=1.0)
    try:
        with socket.create_connection(keeper.address.rsplit(":", 1), timeout=10) as sock:
            challenge(sock)
            sent = 0
            while sent < 1200:  # 60 s of trickling at most: the bound of this wait, not a measured time
                try:
                    sock.sendall(b"{")
                except OSError:
                    break
                sent += 1
                sock.settimeout(0.05)
                try:
                    if sock.recv(1) == b"":
                        break  # closed by the keeper
                except TimeoutError:
                    pass
            assert sent < 1200, "the keeper kept reading the line"
        assert keeper.dropped == 1
    finally:
        keeper.close()


def test_puts_over_the_bounds_are_refused_and_memory_stays_bounded(keeper, capfd):
    files = {f"rank-{r:05d}.safetensors": os.urandom(10_000) for r in range(3)}
    for step in (2, 4):
        for name in list(files)[:2]:
            peer.put(keeper.address, keeper.secret, step, name, sha(files[name]), files[name])
    name3 = "rank-00002.safetensors"
    refusals = {
        "already has the 2 files": (4, name3, files[name3]),  # a third file of a step
        "older than the steps held": (1, NAME, files[NAME]),  # a step the job is past
        "do not fit": (4, NAME, os.urandom(50_001)),  # more bytes than the keeper holds
    }
    for why, (step, name, data) in refusals.items():
        with pytest.raises(ValueError, match=why):
            peer.put(keeper.address, keeper.secret, step, name, sha(data), data)
        assert keeper.held_bytes() == 40_000 and keeper.reserved == 0
    with pytest.raises(ValueError, match="not rank-NNNNN.safetensors"):
        peer.put(keeper.address, keeper.secret, 4, "../../etc/passwd", sha(b"x"), b"x")
    with pytest.raises(ValueError, match="do not have the sha256"):
        peer.put(keeper.address, keeper.secret, 4, NAME, "0" * 64, files[NAME])
    # a newer step replaces the oldest: never more than 2 steps of 2 files
    peer.put(keeper.address, keeper.secret, 6, NAME, sha(files[NAME]), files[NAME])
    assert sorted(keeper.files) == [4, 6] and keeper.held_bytes() == 30_000
    assert keeper.dropped == 0 and warnings(capfd.readouterr().err) == []
    # a rank sees its refusals as one warning line, and the save goes on
    copies = peer.PeerCopies(0, [f"{keeper.secret}@{keeper.address}"])
    for step in (1, 1, 1):
        copies.send(step, NAME, sha(files[NAME]), files[NAME])
    err = capfd.readouterr().err
    assert len(warnings(err)) == 1 and "older than the steps held" in err, err


def test_a_length_of_10_to_the_12_is_never_allocated(keeper, capfd):
    tracemalloc.start()
    try:
        put = {"op": "put", "step": 2, "name": NAME, "sha256": "0" * 64, "bytes": 10**12}
        assert raw(keeper.address, put, b"x" * 1000) == b""  # anyone's: dropped before its length is read
        answer = json.loads(raw(keeper.address, put, b"x" * 1000, secret=keeper.secret))
        assert answer["ok"] is False and "do not fit" in answer["error"]  # the job's: refused, nothing allocated
        # and a rank never allocates what a keeper (or something in its place) claims to send
        with socket.create_server(("127.0.0.1", 0)) as liar:
            address = f"127.0.0.1:{liar.getsockname()[1]}"

            def lie():
                conn, _ = liar.accept()
                with conn:
                    conn.sendall(b'{"nonce": "n"}\n')
                    conn.recv(1 << 16)
                    conn.sendall(json.dumps({"bytes": 10**12}).encode() + b"\n" + b"x" * 1000)

            thread = threading.Thread(target=lie)
            thread.start()
            with pytest.raises(ValueError, match="offers 1000000000000 bytes, the manifest says 1000"):
                peer.get(address, keeper.secret, 2, NAME, 1000)
            thread.join()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak
    assert keeper.reserved == 0 and keeper.held_bytes() == 0
    err = capfd.readouterr().err
    assert len(warnings(err)) == 1 and "Traceback" not in err and "MemoryError" not in err, err


def test_a_frozen_keeper_costs_one_warning_line_and_no_later_wait(capfd):
    with socket.socket() as frozen:  # accepts connections (the kernel does) and never answers
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        copies = peer.PeerCopies(0, [f"{'a' * 32}@{address}"], timeout_s=0.5)
        data = os.urandom(4 << 20)  # more than the socket buffers take
        for step in (2, 4, 6):
            copies.send(step, NAME, sha(data), data)
        frozen.setblocking(False)
        connections = []
        with contextlib.suppress(BlockingIOError):
            while True:
                connections.append(frozen.accept()[0])
        for conn in connections:
            conn.close()
        assert len(connections) == 1, "timed out once, then not asked again"
        err = capfd.readouterr().err
        assert len(warnings(err)) == 1 and "did not take" in err and "no more copies" in err, err
        start = time.monotonic()  # a resume that lists it waits as long, no more
        with pytest.raises(OSError):
            peer.listing(address, "a" * 32, 2, timeout_s=0.5)
        assert time.monotonic() - start < 5


# ---------------------------------------------------------------- one node: loopback only

def listening_on(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port` (/proc/net/tcp, tcp6)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw_address = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.add(socket.inet_ntop(family, raw_address))
    return found


def test_a_one_node_rendezvous_listens_on_loopback_only(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from threefold.launch import rendezvous
    from threefold.launch.local import free_port

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # restored after the test
    port = free_port()
    handler = get_rendezvous_handler(RendezvousParameters(
        backend=rendezvous.register(), endpoint=f"127.0.0.1:{port}", run_id="loopback", min_nodes=1, max_nodes=1,
        local_addr="127.0.0.1", join_timeout=60, last_call_timeout=1, read_timeout=60))
    try:
        first = handler.next_rendezvous().bootstrap_store_info
        assert listening_on(port) == {"127.0.0.1"}, "the rendezvous store"
        assert handler.use_agent_store and first.master_addr == "127.0.0.1"
        assert listening_on(first.master_port) == {"127.0.0.1"}, "the workers' store"
        second = handler.next_rendezvous().bootstrap_store_info  # a restart: a fresh workers' store
        assert second.master_port != first.master_port and listening_on(second.master_port) == {"127.0.0.1"}
        assert listening_on(first.master_port) == set()
    finally:
        handler.shutdown()


def test_a_one_node_launch_hands_the_agent_and_its_workers_loopback_only(monkeypatch):
    import torch.distributed.launcher.api as launcher

    from threefold.launch.local import launch_local
    from threefold.launch.nodes import Nodes

    seen = []

    def elastic_launch(config, entrypoint):
        def run(*args):
            seen.append((config, dict(os.environ), args))
        return run

    monkeypatch.setattr(launcher, "elastic_launch", elastic_launch)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the launch sets for its workers stays here
    assert launch_local(2, ["train", "--model", "tiny"], peer_copy=True) == 0
    assert launch_local(2, ["train", "--model", "tiny"], peer_copy=True,
                        nodes=Nodes(1, 1, 0, "node001.cluster", 29400)) == 0  # one node, a cluster endpoint
    (one, env, args), (named, named_env, _) = seen
    assert (one.rdzv_backend, one.local_addr) == ("threefold-loopback", "127.0.0.1")
    assert one.rdzv_endpoint.startswith("127.0.0.1:")
    for keeper_env in (env, named_env):  # the keeper of a one-node job: on loopback, its secret not on argv
        assert keeper_env[peer.KEEPER_ENV].startswith("127.0.0.1:")
        assert len(keeper_env[peer.SECRET_ENV]) == 32 and keeper_env[peer.SECRET_ENV] not in " ".join(args)
    assert env[peer.SECRET_ENV] != named_env[peer.SECRET_ENV]
    assert (named.rdzv_backend, named.rdzv_endpoint) == ("c10d", "node001.cluster:29400")
