"""What the CUDA path does that a CPU run cannot show by itself, checked with torch.cuda's functions
replaced by recording fakes: the figures' read-back (pinned, non-blocking, an event), the memory
peak, the device index under one visible GPU, the watchdog thread's device, the pipeline's clock."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from threefold import mesh
from threefold.data import Batch
from threefold.observe.hang import Watchdog
from threefold.pipeline import runtime as pipeline_runtime
from threefold.pipeline.runtime import CudaClock, HostClock, PipelineRuntime, clock_for
from threefold.schedules.registry import build_schedule
from threefold.pipeline.stage import Stage
from threefold.train.step import StepResult, TorchDevice, start_read


class _Recorder:
    """A device whose host buffers and copies are recorded (the read-back's shape)."""

    def __init__(self):
        self.numel = []

    def host_buffer(self, numel):
        self.numel.append(numel)
        return torch.empty(numel, dtype=torch.float64)

    def copy_to_host(self, dst, src):
        dst.copy_(src)

    def record_event(self):
        return SimpleNamespace(synchronize=lambda: None)


def test_a_loss_scale_the_host_knows_is_not_copied_to_the_device():
    """Without a loss scaler the scale is the number 1.0: it stays a host number (it was copied to
    the device every step, a blocking host-to-device copy), and only device figures cross, once."""
    result = StepResult(torch.tensor(3.0), torch.tensor(2.0), 0.1, torch.tensor(False), 1.0)
    figures = result.figures()
    assert not isinstance(figures["loss_scale"], torch.Tensor)
    device = _Recorder()
    values = start_read({**figures, "loss_total": torch.tensor(7.0)}, device).values()
    assert device.numel == [3]  # grad_norm, skipped, loss_total: one buffer, one copy
    assert values == {"grad_norm": 2.0, "skipped": 0.0, "loss_scale": 1.0, "loss_total": 7.0}
    assert list(values) == ["grad_norm", "skipped", "loss_scale", "loss_total"]
    assert result.read(torch.tensor(5.0)) == [2.0, 0.0, 1.0, 5.0]


class _FakeCudaEvent:
    """torch.cuda.Event on a fake device clock (`CLOCK[0]`, seconds of device work queued so far)."""

    CLOCK = [0.0]
    log: list = []

    def __init__(self, enable_timing=False):
        self.enable_timing = enable_timing
        self.t = None

    def record(self):
        self.t = self.CLOCK[0]
        self.log.append(("record", threading.current_thread().name))

    def synchronize(self):
        self.log.append(("synchronize", self.t))

    def query(self):
        return True

    def elapsed_time(self, other):
        assert self.enable_timing and other.enable_timing
        return (other.t - self.t) * 1e3


def test_the_cuda_read_back_is_pinned_non_blocking_and_waits_on_an_event(monkeypatch):
    _FakeCudaEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    calls = {}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.setdefault("peak", d) and 12345)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.setdefault("reset", d))
    device = TorchDevice(torch.device("cuda", 2))
    empty = torch.empty

    def pinned_empty(*shape, pin_memory=False, **kw):
        calls["pin_memory"] = pin_memory
        return empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", pinned_empty)
    host = device.host_buffer(3)
    monkeypatch.setattr(torch, "empty", empty)
    assert calls["pin_memory"] is True and host.dtype == torch.float64

    class Dst:
        def copy_(self, src, non_blocking=False):
            calls["non_blocking"] = non_blocking

    device.copy_to_host(Dst(), torch.zeros(3))
    assert calls["non_blocking"] is True
    event = device.record_event()
    assert isinstance(event, _FakeCudaEvent) and _FakeCudaEvent.log == [("record", threading.current_thread().name)]
    assert device.memory_peak() == 12345 and calls["peak"] == torch.device("cuda", 2)
    device.reset_memory_peak()
    assert calls["reset"] == torch.device("cuda", 2)
    cpu = TorchDevice(torch.device("cpu"))
    assert cpu.memory_peak() is None and not cpu.host_buffer(2).is_pinned()


def test_the_device_index_is_the_local_rank_among_the_visible_gpus(monkeypatch):
    """Slurm --gpus-per-task=1 shows each task one GPU: cuda:LOCAL_RANK would not exist there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for visible, local_rank, index in ((1, "5", 0), (8, "5", 5), (4, "5", 1), (8, None, 0), (2, "1", 1)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda visible=visible: visible)
        env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
        assert mesh.cuda_index(env) == index, (visible, local_rank)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mesh.pick_device("cuda") == torch.device("cuda", 0)
    assert mesh.pick_device("cpu") == torch.device("cpu")


def test_the_watchdog_thread_sets_its_device_before_polling(monkeypatch, tmp_path):
    """A new thread's current CUDA device is 0: the watchdog's event queries would open a context on
    GPU 0 on every rank of a node."""
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    polls = []
    comm = SimpleNamespace(mesh=SimpleNamespace(device=torch.device("cuda", 3), global_rank=0), records=[],
                           poll=lambda: polls.append(threading.current_thread().name))
    dog = Watchdog(comm, tmp_path, timeout_s=60, poll_s=0.01, exit_process=False).start()
    deadline = time.monotonic() + 10
    while not polls and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert seen and seen[0] == ("threefold-watchdog", torch.device("cuda", 3)), seen
    assert polls and polls[0] == "threefold-watchdog"


SHAPE = (2, 4, 8)


class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


class _DeviceWork:
    """Stages whose work is queued on the fake device: the host returns at once, the device takes
    5 ms per forward and 10 ms per backward."""

    meter, side_loss = None, 0.0

    def begin(self, global_tokens):
        pass

    def forward(self, stage, x, targets):
        _FakeCudaEvent.CLOCK[0] += 0.005
        return (torch.zeros(()) if stage.last else torch.zeros(SHAPE)), None

    def backward(self, stage, state, grad):
        _FakeCudaEvent.CLOCK[0] += 0.010
        return None if stage.first else torch.zeros(SHAPE)


def test_pipeline_timelines_time_the_device_work_on_cuda(monkeypatch):
    """On CUDA an action's span is the device's (timing events), not the host's issuing of its kernels."""
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    _FakeCudaEvent.CLOCK[0] = 100.0
    schedule = build_schedule("1f1b", 1, 3)
    comm = SimpleNamespace(semantics="native", mesh=SimpleNamespace(rank=lambda axis: 0, device=torch.device("cuda", 0)),
                           batch_send_recv=lambda sends, recvs: [_Done() for _ in sends + recvs])
    runtime = PipelineRuntime(schedule, [Stage(0, range(0), True, True)], _DeviceWork(), comm, lambda shape: SHAPE)
    assert isinstance(runtime.clock, pipeline_runtime.CudaClock)  # chosen from the mesh's device
    comm.mesh.device = torch.device("cpu")  # the tensors of this fake stay on the host
    tokens = torch.zeros(SHAPE[:2], dtype=torch.long)
    runtime.forward_backward([Batch(tokens, tokens)] * 3, 1)
    spans = {(e.kind, e.mb): e.end - e.start for e in runtime.timeline}
    assert set(spans) == {(k, mb) for k in "FB" for mb in range(3)}
    for (kind, _), span in spans.items():
        assert abs(span - (0.005 if kind == "F" else 0.010)) < 1e-9, spans
    starts = [e.start for e in runtime.timeline]
    span = runtime.timeline[-1].end - starts[0]
    assert starts == sorted(starts) and abs(span - 0.045) < 1e-9, span  # the device's 45 ms, not the host's
