"""The peer keeper's wire format (checkpoint/peer.py): JSON lines and raw bytes, no pickle.

On every connection the keeper speaks first, with a challenge: a fresh random nonce,

    {"nonce": N}

A request is one JSON line that carries that nonce and a MAC, then for `put` the file's bytes;
a reply is one JSON line, then for `get` the bytes. `mac` is the hex HMAC-SHA256 under the
keeper's secret of the request's other fields (the nonce among them) as compact JSON with sorted
keys, so a request is good on the connection it was signed for only: one captured and sent
again meets another nonce and is dropped.

    {"op": "put", "step": S, "name": "rank-00002.safetensors", "sha256": H, "bytes": N, "nonce": N, "mac": M}
        ->  {"ok": true}  or  {"ok": false, "error": WHY}
    {"op": "list", "step": S, "nonce": N, "mac": M}  ->  {"files": {name: {"sha256": H, "bytes": N}}}
    {"op": "get", "step": S, "name": NAME, "nonce": N, "mac": M}  ->  {"bytes": N} (N = -1: not held)
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import socket
from collections.abc import Iterator, Mapping

CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 15.0  # the longest a socket waits for the other side to move (connect, each send and receive)
MAX_LINE = 1 << 16  # a request or reply line
MAX_STEP = 1 << 62
CHUNK = 1 << 20
FILE_NAME = re.compile(r"rank-\d{5,9}\.safetensors")


def mac(secret: str, request: Mapping) -> str:
    body = json.dumps(request, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signed(secret: str, request: dict, nonce: str) -> dict:
    """`request` for the connection whose challenge was `nonce`."""
    request = {**request, "nonce": nonce}
    return {**request, "mac": mac(secret, request)}


def send(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    """One JSON line, then `payload` in pieces (each has the socket's timeout; a whole `sendall`
    would have it for all the bytes together)."""
    sock.sendall(json.dumps(header).encode() + b"\n")
    view = memoryview(payload)
    for start in range(0, len(view), CHUNK):
        sock.sendall(view[start:start + CHUNK])


def read_line(stream) -> dict:
    line = stream.readline(MAX_LINE)
    if not line.endswith(b"\n"):
        raise ConnectionError("connection closed or line longer than 64 KiB" if line else "connection closed")
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise ConnectionError(f"connection closed after {0 if data is None else len(data)} of {n} bytes")
    return data


def whole(value, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what} is not a whole number in {low}..{high}")
    return value


def connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=min(CONNECT_TIMEOUT_S, timeout_s))
    sock.settimeout(timeout_s)
    return sock


@contextlib.contextmanager
def asking(address: str, secret: str, request: dict, timeout_s: float, payload: bytes = b"") -> Iterator:
    """Connect, read the keeper's challenge, send `request` signed for it (and `payload`); yields
    the stream the reply comes on."""
    with connect(address, timeout_s) as sock:
        stream = sock.makefile("rb")
        nonce = read_line(stream).get("nonce")
        if not isinstance(nonce, str):
            raise ValueError("the keeper sent no challenge")
        send(sock, signed(secret, request, nonce), payload)
        yield stream
