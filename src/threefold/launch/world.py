"""A world of N local processes joined over gloo, for tests, benchmarks and notebooks.

    with World(4) as world:
        losses = world.run(train_some_steps, config)   # one result per rank

The processes stay up between `run` calls, so many checks share one start-up (importing
torch and joining the world cost seconds on a small machine). A rank that raises fails the
call with `RankError` naming the rank and carrying its traceback; ranks left waiting in a
collective for the failed one are killed, and the next `run` starts a fresh world. A rank
process that dies without a word (killed, crashed) fails the call as soon as it is seen, not at
the timeout. A world that does not form - its port taken by another process between the moment
it was found free and rank 0's store binding it - is started again on another port (up to
`FORM_ATTEMPTS` times) and the call goes on.

The ranks are forked from multiprocessing's fork server, which imports `PRELOAD` once (torch, the
part of it every optimizer's first use imports, threefold's trainer and the `transformers` classes a
Hugging Face directory loads through): a rank starts with them imported instead of paying them
again (~12 CPU-s each on a 2-core machine), and so does every world started later by this process.
The server is this process's own, started with the first world: it keeps the environment of that
moment, so a variable a rank must see is set in the task (or before the first world starts).
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp

from .local import free_port


class RankError(RuntimeError):
    def __init__(self, rank: int | None, detail: str):
        self.rank = rank
        where = f"rank {rank}" if rank is not None else "the world"
        super().__init__(f"{where} failed:\n{detail}")


FORM_ATTEMPTS = 3  # starts of a world whose ranks could not join (its port taken meanwhile)
POLL_S = 1.0  # how often a waiting `run` looks for rank processes that died without a word
# imported once by the fork server the ranks are forked from (a name that fails to import is skipped)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "threefold.train.trainer",
           "transformers.models.auto.configuration_auto", "transformers.modeling_utils"]


class _NotFormed(Exception):
    """A rank could not join the world (the traceback of its init_process_group)."""


def _worker(rank: int, world_size: int, port: int, tasks, results, threads: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    except BaseException:  # the world did not form: say so (ok None), the caller starts another
        results.put((rank, None, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including SystemExit from CLI code
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    def __init__(self, size: int, timeout_s: float = 300.0, threads: int = 1):
        self.size = size
        self.timeout_s = timeout_s
        self.threads = threads
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: with this process's first world
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.size, port, self._tasks[r], self._results, self.threads),
                                   daemon=True) for r in range(self.size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the results in rank order."""
        for _ in range(FORM_ATTEMPTS):
            if not self._procs:
                self._start()
            for q in self._tasks:
                q.put((fn, args, kwargs))
            try:
                return self._collect()
            except _NotFormed as failed:
                self.close(force=True)
                why = str(failed)
        raise RankError(None, f"the world did not form in {FORM_ATTEMPTS} starts:\n{why}")

    def _collect(self) -> list:
        results: dict[int, object] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.size:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(0.1, min(POLL_S, left)))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if r not in results and not p.is_alive()]
                if dead:
                    self._drain_after_failure()
                    rank, code = dead[0]
                    raise RankError(rank, f"its process exited (code {code}) without a result") from None
                if left > 0:
                    continue
                missing = sorted(set(range(self.size)) - set(results))
                self.close()
                raise RankError(None, f"ranks {missing} did not finish within {self.timeout_s:.0f} s") from None
            if ok is None:
                raise _NotFormed(value)
            if not ok:
                self._drain_after_failure()
                raise RankError(rank, value)
            results[rank] = value
        return [results[r] for r in range(self.size)]

    def _drain_after_failure(self, grace_s: float = 2.0) -> None:
        """After a rank failed, give the others a moment to finish, then discard the world."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                self._results.get(timeout=0.1)
            except queue.Empty:
                pass
        self.close(force=True)

    def close(self, force: bool = True, grace_s: float = 5.0) -> None:
        """Stop the ranks: `force` kills them; otherwise each is asked to leave the world and those
        still running `grace_s` later (one shared wait, not one per rank) are killed."""
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + grace_s
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self._procs = []

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=False)


def run_world(size: int, fn, *args, **kwargs) -> list:
    """Start a world of `size`, run fn on every rank, shut the world down; results in rank order."""
    with World(size) as world:
        return world.run(fn, *args, **kwargs)
