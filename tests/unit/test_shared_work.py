"""comm/collectives.py `_Shared`: one Work waited by two threads at once (a dualpipev pair's forward
and backward each waiting for a receive of one point-to-point batch, which NCCL and the nccl test
mode complete as one Work) is waited once; gloo's point-to-point Work never returns from a second wait."""

import threading
import time

from threefold.comm.collectives import _Shared


class OnceWork:
    """Returns from its first wait() after a while; a second wait() never returns (as gloo's p2p Work)."""

    def __init__(self):
        self.waits = 0
        self._forever = threading.Event()

    def wait(self):
        self.waits += 1
        if self.waits > 1:
            self._forever.wait()
        time.sleep(0.05)
        return True

    def is_completed(self):
        return self.waits > 0


def test_two_threads_waiting_at_once_wait_the_work_once():
    shared = _Shared(OnceWork())
    threads = [threading.Thread(target=shared.wait, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads), "a second wait() of the Work: it never returns"
    assert shared.work.waits == 1
