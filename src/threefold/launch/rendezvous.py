"""The rendezvous of a launch whose nodes are all on this machine, with every store it opens on
127.0.0.1 only.

torch's c10d rendezvous binds its TCPStore servers to every interface (`*:PORT`), and those
stores take any client: on a shared machine, anyone who can reach it could write into the
job's rendezvous or the store its workers meet in. A `--nproc` job without `--nnodes`, or one
whose `--rdzv-endpoint` is a loopback address, has all its processes on this machine, so
`threefold-loopback` (registered with torch's rendezvous registry) is that same rendezvous with
its two stores on a socket bound to 127.0.0.1:

- the rendezvous store, at the launch's endpoint (127.0.0.1:PORT), hosted by the node with
  `is_host` (node rank 0; the only node of a one-node launch), the others its clients;
- the workers' store, a fresh one for every round of the rendezvous (every restart), hosted
  by the launcher of the round's rank 0 (torch's "agent store": every node's workers connect to
  it as clients; its port reaches the other nodes through the rendezvous store). A fresh store
  per round is also what the launcher wants after a restart: a store shared across rounds
  keeps the dead workers' gloo addresses, which restarted workers can connect to.

A multi-node job across machines uses torch's own `c10d` backend (docs/multinode.md).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo, RendezvousStoreInfo,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "threefold-loopback"
LOOPBACK = "127.0.0.1"
WORKER_STORE_KEY = "threefold/worker_store_port"  # in the round's part of the rendezvous store


def register() -> str:
    """Make `BACKEND` known to torch's rendezvous registry (again: a no-op); returns its name."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def loopback_store(port: int, timeout_s: float):
    """A TCPStore server listening on 127.0.0.1:`port` only (0: a free port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(1024)
        bound = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return TCPStore(LOOPBACK, bound, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def _create_handler(params):
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=29500)
    timeout_s = params.get_as_int("read_timeout", 60)
    if params.get_as_bool("is_host", True):
        store = loopback_store(port, timeout_s)
    else:  # another node of this machine: node rank 0's launcher hosts the store
        store = TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    # torch's handler then does not open a shared store of its own (on every interface); the
    # workers' store is this module's
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return LoopbackRendezvous(create_handler(store, C10dRendezvousBackend(store, params.run_id), params), timeout_s)


class LoopbackRendezvous(RendezvousHandler):
    """torch's dynamic rendezvous handler (`inner`), but the workers' store of each round is a
    fresh one on 127.0.0.1 that the launcher of the round's rank 0 hosts."""

    def __init__(self, inner, timeout_s: float):
        self.inner, self.timeout_s = inner, timeout_s
        self.worker_store = None  # the current round's

    def next_rendezvous(self):
        info = self.inner.next_rendezvous()
        self.worker_store = None  # the last round's store goes (its workers are gone)
        if info.rank == 0:
            self.worker_store = loopback_store(0, self.timeout_s)
            info.store.set(WORKER_STORE_KEY, str(self.worker_store.port))
        port = int(info.store.get(WORKER_STORE_KEY))  # the round's store: its key is this round's only
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(LOOPBACK, port))

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to `worker_store` as clients

    def get_backend(self) -> str:
        return BACKEND

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self):
        return self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()
