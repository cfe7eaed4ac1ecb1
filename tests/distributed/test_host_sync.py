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
    events, launch, read = [], trainer.step_fn, step_module.StepResult.read

    def launched(step, *args):
        events.append(f"L{step}")
        return launch(step, *args)

    def reading(result, *extra):
        events.append("R")
        return read(result, *extra)

    trainer.step_fn = launched
    step_module.StepResult.read = reading
    try:
        records = trainer.run()
    finally:
        step_module.StepResult.read = read
    return events, [r["step"] for r in records], [r["step_time_s"] for r in records]


def test_a_step_is_read_after_the_next_one_is_launched(worlds, tmp_path):
    """The logged figures of a step are read after the next step is issued, so the host never waits
    for the device between steps; a step with a save (3), or the last (5), is read before going on."""
    for events, steps, times in worlds(2).run(read_order, str(tmp_path)):
        assert events == ["L1", "L2", "R", "L3", "R", "R", "L4", "L5", "R", "R"], events
        assert steps == [1, 2, 3, 4, 5] and all(t > 0 for t in times)
