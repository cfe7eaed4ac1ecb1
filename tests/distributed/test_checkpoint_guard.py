"""An async checkpoint's snapshot against the gradient sync's compression state, which the next
backward updates in place (not the optimizer step): the update must wait for the snapshot."""

from pathlib import Path


def _save_then_backward(out: str) -> dict:
    import threading

    import torch
    from safetensors.torch import load_file
    from torch import nn

    from threefold.checkpoint import checkpointer as ck
    from threefold.checkpoint.state import TrainingState
    from threefold.comm import Comm
    from threefold.comm.compression import StatelessHook
    from threefold.config import TrainConfig
    from threefold.mesh import Layout, Mesh
    from threefold.parallel.data import DataParallelReducer
    from threefold.parallel.master import ShardedOptimizer
    from threefold.sharding import Placement

    # the snapshot is copied only once the next backward has reached the state: at its guard, or
    # (without one) after its in-place update - an order of events, not a delay that load can undo
    reached, armed = threading.Event(), threading.Event()

    class Residual(StatelessHook):  # a compression hook's memory: updated in place at every launch
        def launch(self, bucket, comm, axis):
            bucket.state.setdefault("residual", torch.zeros(4)).add_(1)
            if armed.is_set():
                reached.set()

        def complete(self, bucket):
            pass

    mesh = Mesh(Layout(), torch.device("cpu"))
    comm = Comm(mesh)
    w = nn.Parameter(torch.zeros(4))
    reducer = DataParallelReducer([w], comm, hook=Residual())

    def step():
        reducer.zero_grad()
        with reducer.micro_batch(last=True):
            (w * 2).sum().backward()
        reducer.finish()

    real_snapshot = ck.snapshot

    def late_snapshot(*args, **kwargs):
        reached.wait(timeout=300)  # an upper bound only
        return real_snapshot(*args, **kwargs)

    ck.snapshot = late_snapshot
    try:
        step()  # residual 1
        checkpointer = ck.Checkpointer(Path(out), mesh, comm, async_save=True)
        real_wait = checkpointer.wait_staged
        checkpointer.wait_staged = lambda: (reached.set(), real_wait())[1]  # registered by the guards below
        checkpointer.guard(ShardedOptimizer([], TrainConfig()))  # as the trainer does: the snapshot overlaps backward
        state = TrainingState([("w", w)], {"w": Placement.whole("w", (4,))}, rank_state=reducer,
                              layout={"dp": 1})
        checkpointer.save(1, state, {"layout": {"dp": 1}, "data": {}, "config": {}})
        armed.set()
        step()  # residual 2, once the snapshot has its copy
        checkpointer.close()
    finally:
        ck.snapshot = real_snapshot
    (data,) = Path(out).glob("step-*/*.safetensors")
    saved = [t for name, t in load_file(data).items() if "residual" in name]
    return {"saved": saved[0].tolist(), "now": reducer.state_dict()["bucket.0.residual"].tolist()}


def test_async_snapshot_holds_the_compression_state_of_its_step(worlds, tmp_path):
    (result,) = worlds(1).run(_save_then_backward, str(tmp_path))
    assert result["now"] == [2.0] * 4
    assert result["saved"] == [1.0] * 4  # not the next backward's update
