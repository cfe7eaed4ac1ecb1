"""No host synchronisation inside a training step, for dp, ZeRO-1, ZeRO-3, tp and pp (issue: every
step waited on the host twice). On CPU the fused optimizer kernel the CUDA path runs is switched on
(`fused_on`), so the step under test is the GPU path's; tests/host_sync.py counts every read."""

from tests.helpers import make_config

BASE = ["model.preset=tiny", "model.layers=2", "train.global_batch=4", "train.seq_len=16", "train.steps=3",
        "train.microbatches=2"]
LAYOUTS = {"dp": ["parallel.dp=2"], "zero1": ["parallel.dp=2", "parallel.zero=1"],
           "zero3": ["parallel.dp=2", "parallel.zero=3"], "tp": ["parallel.tp=2"],
           "pp": ["parallel.pp=2", "pipeline.schedule=1f1b"],
           "zero3-fp16": ["parallel.dp=2", "parallel.zero=3", "precision.compute=fp16"]}


def count_syncs(out: str) -> dict:
    import threefold.parallel.master as master
    from tests.host_sync import HostSyncCounter
    from threefold.train.trainer import Trainer

    fused_on, master.fused_on = master.fused_on, lambda device: True  # the CUDA path's optimizer
    found = {}
    try:
        for name, overrides in LAYOUTS.items():
            trainer = Trainer(make_config(BASE + overrides, f"{out}/{name}"))
            trainer.train_one_step()  # the first step may set things up
            step = trainer.step + 1
            micro_batches, _ = trainer.loader.get(step - 1)
            with HostSyncCounter() as counter:
                result = trainer.step_fn(step, micro_batches, trainer.global_tokens)
            trainer.loader.close()
            found[name] = (counter.sites, result.read()[1])
    finally:
        master.fused_on = fused_on
    return found


def test_a_step_reads_nothing_back_to_the_host(worlds, tmp_path):
    for rank, found in enumerate(worlds(2).run(count_syncs, str(tmp_path))):
        for name, (sites, skipped) in found.items():
            assert sites == [], f"rank {rank}, {name}: {sites}"
            assert skipped == 0.0, (rank, name)


def read_order(out: str) -> list:
    """The order in which a run launches steps and reads their figures back (a save at step 3)."""
    from threefold.train import step as step_module
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(BASE + ["parallel.dp=2", "train.steps=5", "checkpoint.save_every=3"], out))
    events, launch, read = [], trainer.step_fn, step_module.PendingRead.values

    class Launched:  # the trainer's step, recording each launch
        def __call__(self, step, *args):
            events.append(f"L{step}")
            return launch(step, *args)

        def drain(self):
            launch.drain()

    def reading(pending):
        events.append("R")
        return read(pending)

    trainer.step_fn = Launched()
    step_module.PendingRead.values = reading
    try:
        records = trainer.run()
    finally:
        step_module.PendingRead.values = read
    return events, [r["step"] for r in records], [r["step_time_s"] for r in records]


def test_a_step_is_read_after_the_next_one_is_launched(worlds, tmp_path):
    """The logged figures of a step are read after the next step is issued, so the host never waits
    for the device between steps; a step with a save (3), or the last (5), is read before going on."""
    for events, steps, times in worlds(2).run(read_order, str(tmp_path)):
        assert events == ["L1", "L2", "R", "L3", "R", "R", "L4", "L5", "R", "R"], events
        assert steps == [1, 2, 3, 4, 5] and all(t > 0 for t in times)


def issue_order(out: str) -> list[str]:
    """Every operation a 3-step run issues, in order, with the read-back's device calls (a recording
    `Device`) and the starts of the steps' launches among them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from threefold.train.step import TorchDevice
    from threefold.train.trainer import Trainer

    log: list[str] = []

    class Recorded:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            log.append("wait")
            self.event.synchronize()

    class RecordingDevice(TorchDevice):
        def copy_to_host(self, dst, src):
            log.append("copy")
            super().copy_to_host(dst, src)

        def record_event(self):
            log.append("event")
            return Recorded(super().record_event())

        def memory_peak(self):
            return 1000 + len(log)  # what a CUDA allocator would report

        def reset_memory_peak(self):
            log.append("reset")

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # views launch nothing
                log.append(str(func))
            return func(*args, **(kwargs or {}))

    trainer = Trainer(make_config(BASE + ["parallel.dp=2", "data.prefetch=0"], out))
    trainer.device = RecordingDevice(trainer.mesh.device)
    launch = trainer.launch_step

    def launching():
        log.append(f"launch {trainer.step + 1}")
        return launch()

    trainer.launch_step = launching
    with Ops():
        records = trainer.run()
    log.append(f"peaks {[r['mem']['peak'] for r in records]}")
    return log


def test_a_steps_figures_are_copied_before_the_next_step_is_issued(worlds, tmp_path):
    """Step N's figures go to the host by one copy and an event issued right after step N, before
    any operation of step N+1 (on one CUDA stream a copy issued later waits for step N+1 too); the host
    waits for that event only after step N+1 is issued. Each step's memory peak is its own (reset)."""
    for log in worlds(2).run(issue_order, str(tmp_path)):
        launch2 = log.index("launch 2")
        first_op2 = next(i for i in range(launch2, len(log)) if log[i].startswith("aten.") or log[i] == "reset")
        copy1 = log.index("copy")
        assert copy1 < launch2 < first_op2, log[copy1 - 3: first_op2 + 1]
        assert log[copy1 + 1: copy1 + 3] == ["aten.copy_.default", "event"], log[copy1: copy1 + 3]
        copy2 = log.index("copy", launch2)
        assert copy2 < log.index("wait") < log.index("launch 3")  # step 1 is read after step 2 is issued ...
        assert log.count("copy") == log.count("event") == 3  # ... and each step's figures cross once
        wait1 = log.index("wait")  # the read touches only host memory: no operation follows the wait
        assert not log[wait1 + 1].startswith("aten."), log[wait1: wait1 + 2]
        for n in (1, 2, 3):
            assert log[log.index(f"launch {n}") + 1] == "reset", n  # the peak is reset as each step begins
        peaks = eval(log[-1].removeprefix("peaks "))
        assert len(set(peaks)) == 3, peaks  # the device's peak of each step, not the sum of the counted bytes
