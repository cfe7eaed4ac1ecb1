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

A keeper lets no one else in. Each keeper draws a random secret when it starts; its launcher
hands the secret to the processes it starts in the environment (`THREEFOLD_PEER_SECRET`, never
on a command line), and the ranks of a world exchange their keepers' `secret@host:port` with
one all-reduce, so every rank can reach every keeper of its world and nothing else can. Every
request carries an HMAC-SHA256 under the keeper's secret of the request's header, which names
the payload's sha256 (`put`) and the nonce the keeper sent when the connection opened (so a
captured request does not replay); the keeper checks the MAC before it looks at anything else
and the payload's sha256 once it has it. A request without a valid MAC for its connection is
dropped, and the first one dropped costs one warning line on the launcher's terminal. What a keeper holds is bounded
by what the job writes: the `KEPT_STEPS` newest steps, at most `max_files` files a step (the
node's processes and its ring peer's), names of the form `rank-NNNNN.safetensors`, and
`max_bytes` in all (a length is checked against that before anything is allocated). Every
socket, the keeper's and the ranks', has a timeout: a keeper that stops answering costs a rank
one warning line and the rest of its copies, not the save. Connections are bounded too: at most
`max_connections` at once, each sends its whole request line within `request_deadline_s`
however slowly its bytes come, and when every place is taken a new connection takes the place of
the oldest one that has not yet sent a valid request, so idle or slow connections cannot keep
the job's own requests out. The wire format is in peer_wire.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

from .peer_wire import FILE_NAME, IO_TIMEOUT_S, MAX_LINE, MAX_STEP, asking, mac, read_exact, read_line, send, whole

KEEPER_ENV = "THREEFOLD_PEER_KEEPER"  # host:port of this node's keeper, set by the launcher for its processes
SECRET_ENV = "THREEFOLD_PEER_SECRET"  # that keeper's secret, set by the launcher for its processes
KEPT_STEPS = 2  # the newest complete checkpoint and the one being written
MAX_CONNECTIONS = 64  # served at once; a new one takes the place of the oldest that has sent no valid request


def memory_cap() -> int:
    """The most a keeper holds by default: half of this machine's memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 << 30


# ---------------------------------------------------------------- the keeper (in the launcher)

class _Dropped(Exception):
    """A request that is not from this job (or not one at all): closed without a reply."""


class _Silent(Exception):
    """A connection that sent nothing: closed, nothing to say."""


class _Refused(Exception):
    """A request of this job the keeper will not serve: answered with the reason."""


class Keeper:
    """Holds the files of the `KEPT_STEPS` newest steps it was sent, in RAM; serves them to the
    processes that know its secret.

    `max_files`: files a step (the ranks of this node and of its ring peer); `max_bytes`: bytes
    held and being received, in all; `timeout_s`: how long a connection may stay silent;
    `max_connections`: connections served at once; `request_deadline_s`: how long a connection
    may take to send its whole request line (default `timeout_s`).
    """

    def __init__(self, bind: str = "127.0.0.1", advertise: str | None = None, secret: str | None = None,
                 max_files: int = 64, max_bytes: int | None = None, timeout_s: float = IO_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, request_deadline_s: float | None = None):
        self.files: dict[int, dict[str, tuple[str, bytes]]] = {}  # step -> name -> (sha256, bytes)
        self.secret = secret or secrets.token_hex(16)
        self.max_files = max_files
        self.max_bytes = memory_cap() if max_bytes is None else max_bytes
        self.timeout_s = timeout_s
        self.request_deadline_s = timeout_s if request_deadline_s is None else request_deadline_s
        self.max_connections = max_connections
        self.reserved = 0  # bytes of puts being received
        self.dropped = 0  # requests dropped (not from this job, or not requests)
        self.refused = 0  # requests of this job refused (over a bound)
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # notified when a place is given back
        self.holding: set[socket.socket] = set()  # connections with a place
        self.unproven: dict[socket.socket, tuple] = {}  # of those, the ones without a valid request yet, oldest first
        keeper = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = timeout_s  # every receive and send of a connection

            def handle(self):
                keeper._handle(self.rfile, self.connection, self.client_address)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

        self.server = Server((bind, 0), Handler)
        self.address = f"{advertise or bind}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="threefold-peer-keeper", daemon=True)
        self.thread.start()

    def environment(self) -> dict[str, str]:
        """What the launcher's processes need to reach this keeper."""
        return {KEEPER_ENV: self.address, SECRET_ENV: self.secret}

    def held_bytes(self) -> int:
        with self.lock:
            return sum(len(data) for held in self.files.values() for _, data in held.values())

    def _handle(self, rfile, sock: socket.socket, client) -> None:
        """One connection; nothing it sends can raise past here (no traceback on the terminal)."""
        if not self._enter(sock, client):
            return self._drop(client, f"more than {self.max_connections} connections at once")
        try:
            nonce = secrets.token_hex(16)
            try:
                send(sock, {"nonce": nonce})  # the challenge a request of this connection is signed for
            except OSError:
                raise _Silent() from None
            self._serve(self._request(rfile, sock, nonce), rfile, sock)
        except _Dropped as e:
            self._drop(client, str(e))
        except _Silent:
            pass
        except _Refused as e:
            with self.lock:
                self.refused += 1
            try:
                send(sock, {"ok": False, "error": str(e)})
            except OSError:
                pass
        except (OSError, ValueError, MemoryError):
            pass  # an authenticated client went away mid-request: it sees a closed connection, uses storage
        finally:
            with self.room:
                self.unproven.pop(sock, None)
                if sock in self.holding:  # not when its place went to a newer connection
                    self.holding.discard(sock)
                    self.room.notify()

    def _enter(self, sock: socket.socket, client) -> bool:
        """A place among `max_connections`. When every place is taken, the oldest connection that has
        not sent a valid request yet is closed and its place goes to this one at once (a connection
        of the job sends its request as soon as it connects, so only idle or slow ones give way);
        when every place serves a valid request, this one waits for a place, up to `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        evicted = None
        with self.room:
            while len(self.holding) >= self.max_connections and evicted is None:
                if self.unproven:
                    evicted = next(iter(self.unproven.items()))
                    del self.unproven[evicted[0]]
                    self.holding.discard(evicted[0])
                else:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.room.wait(left):
                        return False
            self.holding.add(sock)
            self.unproven[sock] = client
        if evicted is not None:
            self._drop(evicted[1], f"no valid request while {self.max_connections} connections were open")
            try:
                evicted[0].shutdown(socket.SHUT_RDWR)  # its handler sees the end of the stream and leaves
            except OSError:
                pass
        return True

    def _request_line(self, rfile, sock: socket.socket) -> bytes:
        """The request line, whole within `request_deadline_s` however slowly its bytes come."""
        deadline = time.monotonic() + self.request_deadline_s
        line = b""
        while not line.endswith(b"\n") and len(line) < MAX_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Dropped(f"no whole request line within {self.request_deadline_s:g} s")
            sock.settimeout(left)
            try:
                ahead = rfile.peek(1)  # at most one receive
            except OSError as e:
                raise _Dropped(f"no request ({e or type(e).__name__})") from None
            if not ahead:
                break  # closed
            cut = ahead.find(b"\n")
            line += rfile.read(min(len(ahead) if cut < 0 else cut + 1, MAX_LINE - len(line)))
        sock.settimeout(self.timeout_s)
        return line

    def _request(self, rfile, sock: socket.socket, nonce: str) -> dict:
        """The request line, authenticated for this connection's `nonce` and checked field by field."""
        line = self._request_line(rfile, sock)
        if not line:
            raise _Silent()  # connected and closed: not a request
        if not line.endswith(b"\n"):
            raise _Dropped("an unfinished request line" if len(line) < MAX_LINE else
                           "a request line longer than 64 KiB")
        try:
            request = json.loads(line)
        except (ValueError, RecursionError):
            raise _Dropped("not a JSON request") from None
        if not isinstance(request, dict) or not isinstance(request.get("mac"), str):
            raise _Dropped("no MAC")
        given = request.pop("mac")
        if not hmac.compare_digest(given.encode(), mac(self.secret, request).encode()):
            raise _Dropped("a wrong MAC")
        if request.get("nonce") != nonce:
            raise _Dropped("a request signed for another connection (a replay)")
        with self.lock:
            self.unproven.pop(sock, None)  # the job's own: it keeps its place
        try:  # from a process of this job: checked all the same
            if request.get("op") not in ("put", "list", "get"):
                raise ValueError(f"op {request.get('op')!r} is not put, list or get")
            whole(request.get("step"), 0, MAX_STEP, "step")
            if request["op"] != "list" and not (isinstance(request.get("name"), str)
                                                and FILE_NAME.fullmatch(request["name"])):
                raise ValueError(f"name {request.get('name')!r} is not rank-NNNNN.safetensors")
            if request["op"] == "put":
                whole(request.get("bytes"), 0, MAX_STEP, "bytes")
                if not (isinstance(request.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", request["sha256"])):
                    raise ValueError("sha256 is not 64 hex digits")
        except ValueError as e:
            raise _Refused(str(e)) from None
        return request

    def _drop(self, client, why: str) -> None:
        with self.lock:
            self.dropped += 1
            first = self.dropped == 1
        if first:
            print(f"threefold: warning: checkpoint.peer_copy: the keeper at {self.address} dropped a request from "
                  f"{client[0]}:{client[1]} ({why}); it drops any other request not from this job without a word",
                  file=sys.stderr, flush=True)

    def _serve(self, request: dict, rfile, sock: socket.socket) -> None:
        op, step = request["op"], request["step"]
        if op == "put":
            name, size = request["name"], request["bytes"]
            self._admit(step, name, size)
            try:
                data = read_exact(rfile, size)
                if hashlib.sha256(data).hexdigest() != request["sha256"]:
                    raise _Refused("the bytes do not have the sha256 the request names")
                self.keep(step, name, request["sha256"], data)
            finally:
                with self.lock:
                    self.reserved -= size
            send(sock, {"ok": True})
        elif op == "list":
            with self.lock:
                held = dict(self.files.get(step, {}))
            send(sock, {"files": {n: {"sha256": h, "bytes": len(d)} for n, (h, d) in held.items()}})
        else:
            with self.lock:
                found = self.files.get(step, {}).get(request["name"])
            if found is None:
                send(sock, {"bytes": -1})
            else:
                send(sock, {"bytes": len(found[1])}, memoryview(found[1]))

    def _admit(self, step: int, name: str, size: int) -> None:
        """Make room for a put of `size` bytes (reserved until it is kept or fails), or refuse it."""
        with self.lock:
            steps = sorted(self.files)
            if step not in self.files and len(steps) >= KEPT_STEPS:
                if step < steps[0]:
                    raise _Refused(f"step {step} is older than the steps held ({', '.join(map(str, steps))})")
                for old in steps[:len(steps) - KEPT_STEPS + 1]:  # a newer step is being written: the oldest goes
                    del self.files[old]
            held = self.files.get(step, {})
            if name not in held and len(held) >= self.max_files:
                raise _Refused(f"step {step} already has the {self.max_files} files this keeper holds a step")
            in_use = self.reserved + sum(len(d) for files in self.files.values() for n, (_, d) in files.items()
                                         if files is not held or n != name)
            if in_use + size > self.max_bytes:
                raise _Refused(f"{size} bytes do not fit: this keeper holds at most {self.max_bytes} bytes and "
                               f"{in_use} are in use")
            self.reserved += size

    def keep(self, step: int, name: str, sha256: str, data: bytes) -> None:
        with self.lock:
            self.files.setdefault(step, {})[name] = (sha256, data)
            for old in sorted(self.files)[:-KEPT_STEPS]:
                del self.files[old]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_keeper(on_loopback: bool, max_files: int) -> Keeper:
    """The keeper of a launcher: on 127.0.0.1 when every node is on this machine (or there is
    one), else on every interface, advertised under this host's name (as torch's agent
    advertises itself). `max_files`: the files of a step it may hold."""
    return Keeper("127.0.0.1", max_files=max_files) if on_loopback else \
        Keeper("0.0.0.0", socket.getfqdn(), max_files=max_files)


# ---------------------------------------------------------------- clients (in the workers)

def put(address: str, secret: str, step: int, name: str, sha256: str, data: bytes,
        timeout_s: float = IO_TIMEOUT_S) -> None:
    request = {"op": "put", "step": step, "name": name, "sha256": sha256, "bytes": len(data)}
    with asking(address, secret, request, timeout_s, data) as stream:
        reply = read_line(stream)
    if reply.get("ok") is not True:
        raise ValueError(f"the keeper refused it: {reply.get('error', 'no reason given')}")


def listing(address: str, secret: str, step: int, timeout_s: float = IO_TIMEOUT_S) -> dict[str, dict]:
    with asking(address, secret, {"op": "list", "step": step}, timeout_s) as stream:
        files = read_line(stream).get("files")
    if not isinstance(files, dict):
        raise ValueError("not a file listing")
    return files


def get(address: str, secret: str, step: int, name: str, size: int, timeout_s: float = IO_TIMEOUT_S) -> bytes | None:
    """The file's bytes, None when not held; a keeper that offers another size than `size` (the
    manifest's) is not read from."""
    with asking(address, secret, {"op": "get", "step": step, "name": name}, timeout_s) as stream:
        offered = read_line(stream).get("bytes")
        if offered == -1:
            return None
        if offered != size or type(offered) is not int:
            raise ValueError(f"the keeper offers {offered!r} bytes, the manifest says {size}")
        return read_exact(stream, size)


def _address_and_secret(keeper: str) -> tuple[str, str]:
    """`secret@host:port` -> (host:port, secret)."""
    secret, _, address = keeper.rpartition("@")
    return address, secret


class PeerCopies:
    """A rank's view of the keepers of its world: where its files go, where files are found.

    `keepers[r]` is the keeper of global rank r (its node's launcher) as `secret@host:port`.
    Nodes are ordered by their lowest global rank; a rank sends its file to its own node's keeper
    and to the one of the node before it (ring), so losing any one node leaves a copy of every
    file. A keeper that did not answer in time is not asked again by this process.
    """

    def __init__(self, rank: int, keepers: list[str], timeout_s: float | None = None):
        parsed = [_address_and_secret(keeper) for keeper in keepers]
        self.secrets = dict(parsed)
        addresses = [address for address, _ in parsed]
        self.nodes = list(dict.fromkeys(addresses))  # distinct keepers, by lowest rank
        self.mine = addresses[rank]
        index = self.nodes.index(self.mine)
        self.replica = self.nodes[index - 1] if len(self.nodes) > 1 else None
        self.timeout_s = IO_TIMEOUT_S if timeout_s is None else timeout_s
        self.silent: set[str] = set()  # keepers that did not answer: not asked again
        self.warned = False

    @staticmethod
    def local_address(env: Mapping[str, str]) -> str:
        """This node's keeper as `secret@host:port` (what the ranks of a world exchange)."""
        from ..errors import ConfigError

        address, secret = env.get(KEEPER_ENV, ""), env.get(SECRET_ENV, "")
        if not address or not secret:
            raise ConfigError("checkpoint.peer_copy", "the in-memory copies are held by threefold's launcher; start "
                              "the job with threefold train --nproc / --nnodes, or set checkpoint.peer_copy=false")
        return f"{secret}@{address}"

    def send(self, step: int, name: str, sha256: str, data: bytes) -> None:
        """Copy one written file to this node's keeper and the peer's; storage stays the truth, so
        a keeper that cannot take it costs one warning, not the save."""
        for address in (self.mine, self.replica):
            if address is None or address in self.silent:
                continue
            try:
                put(address, self.secrets[address], step, name, sha256, data, self.timeout_s)
            except OSError as e:  # unreachable or silent (a timeout): this process sends it nothing more
                self.silent.add(address)
                self._warn(f"the keeper at {address} did not take {name} of step {step} "
                           f"({e or type(e).__name__}); this rank sends it no more copies and a restart reads "
                           "its files from storage")
            except ValueError as e:
                self._warn(f"the keeper at {address} did not take {name} of step {step} ({e}); a restart "
                           "reads that file from storage")

    def _warn(self, text: str) -> None:
        if not self.warned:
            print(f"threefold: warning: checkpoint.peer_copy: {text}", file=sys.stderr, flush=True)
            self.warned = True

    def fetch(self, address: str, step: int, name: str, size: int) -> bytes | None:
        if address in self.silent:
            raise ConnectionError("it did not answer before")
        try:
            return get(address, self.secrets[address], step, name, size, self.timeout_s)
        except OSError:
            self.silent.add(address)
            raise

    def files_of(self, ckpt: Path, manifest) -> "MemoryFiles":
        """Which of `manifest`'s files the keepers of this world hold (size and sha256 as the
        manifest says), this node's keeper first."""
        where: dict[str, str] = {}
        for address in sorted(self.nodes, key=lambda a: a != self.mine):
            if address in self.silent:
                continue
            try:
                held = listing(address, self.secrets[address], manifest.step, self.timeout_s)
            except OSError:
                self.silent.add(address)
                continue
            except ValueError:
                continue
            for name, info in held.items():
                want = manifest.files.get(name)
                if want is not None and name not in where and isinstance(info, dict) and \
                        info.get("sha256") == want.sha256 and info.get("bytes") == want.bytes:
                    where[name] = address
        return MemoryFiles(Path(ckpt), manifest, where, self.fetch)


class MemoryFiles:
    """A checkpoint's files as a source for the reader (reader.FileSource): from a keeper's memory
    when one holds them and the bytes match the manifest, else None, after checking the file on
    storage (which the resume's verification left to this). Counts where each file came from."""

    def __init__(self, ckpt: Path, manifest, where: dict[str, str],
                 fetch: Callable[[str, int, str, int], bytes | None]):
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
            data = self.fetch(address, self.manifest.step, name, info.bytes)
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
