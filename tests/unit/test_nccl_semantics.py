"""NCCL's semantics emulated on CPU: one Work per p2p batch, completion (not the return of
wait()) as the end of a collective, the validator's stream rules, eager communicators."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from threefold.comm import collectives
from threefold.comm.collectives import Comm
from threefold.observe.hang import Watchdog, in_flight
from threefold.schedules.registry import Schedule, ScheduleError, add_communication, build_schedule, compute_orders, \
    validate


class _Mesh:
    global_rank, world_size = 0, 2
    device = torch.device("cpu")

    def size(self, axis):
        return 2

    def rank(self, axis):
        return 0

    def ranks(self, axis):
        return [0, 1]

    def group(self, axis):
        return None

    def global_rank_of(self, axis, index):
        return index


class _Work:
    """NCCL's Work as the host sees it: wait() returns at once (the stream waits), completion later."""

    def __init__(self, done=False):
        self.done = done
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True

    def is_completed(self):
        return self.done


def test_batch_handles_accept_one_work_per_op_and_one_per_batch():
    comm = Comm(_Mesh(), semantics="nccl")
    records = [collectives.CollectiveRecord(i, "recv", "pp", (), "float32", 0, "x", 0.0) for i in range(3)]
    per_op = [_Work(True) for _ in records]
    assert [h._work.work for h in comm._batch_handles(per_op, records)] == per_op  # noqa
    one = _Work()
    handles = comm._batch_handles([one], records)
    assert len(handles) == 3  # every receive keeps its handle (NCCL's coalesced batch)
    for h in handles:
        h.wait()
    assert one.waits == 1 and all(r.end is None for r in records)  # waited, not completed
    one.done = True
    comm.records.extend(records)
    comm.poll()
    assert all(r.end is not None for r in records)
    with pytest.raises(RuntimeError, match="2 works for 3 ops"):
        comm._batch_handles([_Work(), _Work()], records)


def test_watchdog_sees_a_collective_whose_wait_returned_but_never_completed(tmp_path, monkeypatch):
    work = _Work()
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda *a, **k: work)
    comm = Comm(_Mesh(), semantics="nccl")
    comm.all_reduce(torch.ones(4), "dp", tag="metrics")  # blocking call: returns as NCCL's does
    assert work.waits == 1 and [r.op for r in in_flight(comm)] == ["all_reduce.metrics"]
    dog = Watchdog(comm, tmp_path, timeout_s=0.2, grace_s=0.5, poll_s=0.05, exit_process=False).start()
    deadline = time.monotonic() + 20
    while not (tmp_path / "hang-report.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert "all_reduce.metrics on dp" in json.loads((tmp_path / "rank-0.json").read_text())["reason"]
    work.done = True
    assert in_flight(comm) == []


def _old_interleaved(p, m, v):
    """The interleaved schedule with the latest-receive posting the other schedules use."""
    orders = compute_orders("interleaved", p, m, v)
    return Schedule("interleaved", p, m, v, tuple(tuple(r) for r in add_communication(orders, p, v)))


def test_validator_nccl_rules_reject_a_posting_that_only_nccl_deadlocks():
    old = _old_interleaved(2, 4, 2)
    validate(old, rules=("host",))  # fine when sends and postings never block
    with pytest.raises(ScheduleError, match="deadlocks under NCCL's rules"):
        validate(old, rules=("nccl",))
    validate(build_schedule("interleaved", 2, 4, 2))  # the aligned posting passes both


def test_interleaved_passes_both_rules_for_many_micro_batch_counts():
    """The grid of test_schedules.py checks every schedule under both rules up to p=16, m=64;
    here the interleaved one (the one that deadlocked) for more micro-batch counts."""
    for p, ms, vs in ((2, range(2, 65), (2, 3)), (4, range(4, 65, 5), (2, 4))):
        for m in ms:
            for v in vs:
                validate(build_schedule("interleaved", p, m, v))


def test_process_group_is_bound_to_the_device_on_cuda(monkeypatch):
    from threefold import mesh

    calls = {}
    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh.torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(mesh.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setenv("RANK", "0")
    device = torch.device("cuda", 0)
    mesh.init_distributed(device, 60)
    assert calls["backend"] == "nccl" and calls["device_id"] == device and calls["set_device"] == device
    calls.clear()
    mesh.init_distributed(torch.device("cpu"), 60)
    assert calls["backend"] == "gloo" and "device_id" not in calls
