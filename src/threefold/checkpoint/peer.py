"""In-memory copies of the newest checkpoint on this node and on a peer node, for fast recovery.

With `checkpoint.peer_copy`, each node's launcher runs a `Keeper`: a small TCP server (a thread
of the launcher, so it outlives the node's workers but not the launcher) that holds in RAM the
safetensors files of the newest checkpoints its processes sent it. After writing its file, a
rank sends the same bytes to its own node's keeper and to the keeper of the node before it in
the world's node order (a ring: node i keeps node i+1's files), before its part record marks
the file done. When a node is lost, the nodes left hold every file of the newest checkpoint in
memory: a restarted rank lists the keepers of its world, and reads each file it needs from one
that holds it, not from storage.

The checkpoint's manifest on storage stays the truth: a file from memory is used only when its
size and sha256 are the manifest's. A missing, unreachable or altered copy falls back to the
file on storage (which is verified then), with one warning line for the world.

Wire format (no pickle): a request is one JSON line, then for `put` the file's bytes; a reply
is one JSON line, then for `get` the bytes.

    {"op": "put", "step": S, "name": "rank-00002.safetensors", "sha256": H, "bytes": N}
    {"op": "list", "step": S}  ->  {"files": {name: {"sha256": H, "bytes": N}}}
    {"op": "get", "step": S, "name": NAME}  ->  {"bytes": N} (N = -1: not held)
"""

from __future__ import annotations

import hashlib
import json
import socket
import socketserver
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

KEEPER_ENV = "THREEFOLD_PEER_KEEPER"  # host:port of this node's keeper, set by the launcher for its processes
KEPT_STEPS = 2  # the newest complete checkpoint and the one being written
CONNECT_TIMEOUT_S = 5.0
MAX_LINE = 1 << 16


def _send(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    sock.sendall(json.dumps(header).encode() + b"\n")
    if payload:
        sock.sendall(payload)


def _read_line(stream) -> dict:
    line = stream.readline(MAX_LINE)
    if not line.endswith(b"\n"):
        raise ConnectionError("connection closed or request too long")
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise ConnectionError(f"connection closed after {0 if data is None else len(data)} of {n} bytes")
    return data


# ---------------------------------------------------------------- the keeper (in the launcher)

class Keeper:
    """Holds the files of the `KEPT_STEPS` newest steps it was sent, in RAM; serves them."""

    def __init__(self, bind: str = "127.0.0.1", advertise: str | None = None):
        self.files: dict[int, dict[str, tuple[str, bytes]]] = {}  # step -> name -> (sha256, bytes)
        self.lock = threading.Lock()
        keeper = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                try:
                    keeper._serve(_read_line(self.rfile), self.rfile, self.connection)
                except (OSError, ValueError, KeyError, TypeError):
                    pass  # a broken request: the client sees a closed connection and uses storage

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server((bind, 0), Handler)
        self.address = f"{advertise or bind}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="threefold-peer-keeper", daemon=True)
        self.thread.start()

    def _serve(self, request: dict, rfile, sock: socket.socket) -> None:
        op, step = request["op"], int(request["step"])
        if op == "put":
            size = int(request["bytes"])
            data = _read_exact(rfile, size)
            self.keep(step, str(request["name"]), str(request["sha256"]), data)
            _send(sock, {"ok": True})
        elif op == "list":
            with self.lock:
                held = dict(self.files.get(step, {}))
            _send(sock, {"files": {n: {"sha256": h, "bytes": len(d)} for n, (h, d) in held.items()}})
        elif op == "get":
            with self.lock:
                found = self.files.get(step, {}).get(str(request["name"]))
            if found is None:
                _send(sock, {"bytes": -1})
            else:
                _send(sock, {"bytes": len(found[1])}, memoryview(found[1]))

    def keep(self, step: int, name: str, sha256: str, data: bytes) -> None:
        with self.lock:
            self.files.setdefault(step, {})[name] = (sha256, data)
            for old in sorted(self.files)[:-KEPT_STEPS]:
                del self.files[old]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_keeper(on_loopback: bool) -> Keeper:
    """The keeper of a launcher: on 127.0.0.1 when every node is on this machine, else on every
    interface, advertised under this host's name (as torch's agent advertises itself)."""
    return Keeper("127.0.0.1") if on_loopback else Keeper("0.0.0.0", socket.getfqdn())


# ---------------------------------------------------------------- clients (in the workers)

def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    sock.settimeout(None)
    return sock


def put(address: str, step: int, name: str, sha256: str, data: bytes) -> None:
    with _connect(address) as sock:
        _send(sock, {"op": "put", "step": step, "name": name, "sha256": sha256, "bytes": len(data)}, data)
        if not _read_line(sock.makefile("rb")).get("ok"):
            raise ConnectionError("the keeper did not take the file")


def listing(address: str, step: int) -> dict[str, dict]:
    with _connect(address) as sock:
        _send(sock, {"op": "list", "step": step})
        files = _read_line(sock.makefile("rb")).get("files")
    if not isinstance(files, dict):
        raise ValueError("not a file listing")
    return files


def get(address: str, step: int, name: str) -> bytes | None:
    with _connect(address) as sock:
        _send(sock, {"op": "get", "step": step, "name": name})
        stream = sock.makefile("rb")
        size = int(_read_line(stream)["bytes"])
        return None if size < 0 else _read_exact(stream, size)


class PeerCopies:
    """A rank's view of the keepers of its world: where its files go, where files are found.

    `keepers[r]` is the keeper address of global rank r (its node's launcher). Nodes are ordered
    by their lowest global rank; a rank sends its file to its own node's keeper and to the one of
    the node before it (ring), so losing any one node leaves a copy of every file.
    """

    def __init__(self, rank: int, keepers: list[str]):
        self.nodes = list(dict.fromkeys(keepers))  # distinct keepers, by lowest rank
        self.mine = keepers[rank]
        index = self.nodes.index(self.mine)
        self.replica = self.nodes[index - 1] if len(self.nodes) > 1 else None
        self.warned = False

    @staticmethod
    def local_address(env: Mapping[str, str]) -> str:
        from ..errors import ConfigError

        address = env.get(KEEPER_ENV, "")
        if not address:
            raise ConfigError("checkpoint.peer_copy", "the in-memory copies are held by threefold's launcher; start "
                              "the job with threefold train --nproc / --nnodes, or set checkpoint.peer_copy=false")
        return address

    def send(self, step: int, name: str, sha256: str, data: bytes) -> None:
        """Copy one written file to this node's keeper and the peer's; storage stays the truth, so
        a keeper that cannot take it costs one warning, not the save."""
        for address in (self.mine, self.replica):
            if address is None:
                continue
            try:
                put(address, step, name, sha256, data)
            except (OSError, ValueError) as e:
                if not self.warned:
                    print(f"threefold: warning: checkpoint.peer_copy: the keeper at {address} did not take "
                          f"{name} of step {step} ({e}); a restart reads that file from storage", file=sys.stderr,
                          flush=True)
                    self.warned = True

    def files_of(self, ckpt: Path, manifest) -> "MemoryFiles":
        """Which of `manifest`'s files the keepers of this world hold (size and sha256 as the
        manifest says), this node's keeper first."""
        where: dict[str, str] = {}
        for address in sorted(self.nodes, key=lambda a: a != self.mine):
            try:
                held = listing(address, manifest.step)
            except (OSError, ValueError):
                continue
            for name, info in held.items():
                want = manifest.files.get(name)
                if want is not None and name not in where and info.get("sha256") == want.sha256 \
                        and info.get("bytes") == want.bytes:
                    where[name] = address
        return MemoryFiles(Path(ckpt), manifest, where)


class MemoryFiles:
    """A checkpoint's files as a source for the reader (reader.FileSource): from a keeper's memory
    when one holds them and the bytes match the manifest, else None, after checking the file on
    storage (which the resume's verification left to this). Counts where each file came from."""

    def __init__(self, ckpt: Path, manifest, where: dict[str, str],
                 fetch: Callable[[str, int, str], bytes | None] = get):
        self.ckpt, self.manifest, self.where, self.fetch = ckpt, manifest, where, fetch
        self.from_memory = 0
        self.from_storage = 0
        self.fallbacks: list[str] = []  # "name ...: why" of every file read from storage instead

    def open(self, name: str):
        from safetensors.torch import load

        address = self.where.get(name)
        if address is None:  # verified on storage by the resume already
            self.fallbacks.append(f"{name}: no keeper of this world holds it")
            self.from_storage += 1
            return None
        info = self.manifest.files[name]
        try:
            data = self.fetch(address, self.manifest.step, name)
            why = "gone from the keeper" if data is None else (
                f"{len(data)} bytes, the manifest says {info.bytes}" if len(data) != info.bytes else
                "sha256 mismatch" if hashlib.sha256(data).hexdigest() != info.sha256 else None)
        except (OSError, ValueError, KeyError) as e:
            why = f"keeper {address} unreachable ({e})"
        if why is None:
            self.from_memory += 1
            return load(data)
        self.fallbacks.append(f"{name} from {address}: {why}")
        self._check_storage(name)
        self.from_storage += 1
        return None

    def _check_storage(self, name: str) -> None:
        from .format import CheckpointError
        from .verify import verify_files

        problems = verify_files(self.ckpt, self.manifest, [name])
        if problems:
            raise CheckpointError(f"checkpoint {self.ckpt}: the in-memory copy of {name} is unusable and the file "
                                  f"on storage failed verification ({'; '.join(problems)})")
