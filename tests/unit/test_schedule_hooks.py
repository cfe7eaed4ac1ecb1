"""A schedule's registration names its own runtime and step (schedules/table.py): the trainer asks
`make_step`, names no schedule, and a new entry plugs a step in with no other change."""

import dataclasses
import pkgutil
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from threefold.schedules import table
from threefold.train import step as step_module

SRC = Path(__file__).resolve().parents[2] / "src" / "threefold"


def _parallel(schedule: str) -> SimpleNamespace:
    """The parts of a ParallelModel a step's set-up reads, with a pipeline running `schedule`."""
    pipeline = SimpleNamespace(schedule=SimpleNamespace(name=schedule), on_update=None, in_flight=False)
    return SimpleNamespace(pipeline=pipeline, grad_sync=None, scaler=None, meter=None, documents=None)


class RecordingStep(step_module.TrainStep):
    """A schedule's own step, as a new entry would name it."""


def test_the_registration_names_the_step_the_trainer_runs(monkeypatch):
    from threefold.pipeline import two_bw
    from threefold.train.two_bw_step import TwoBWStep

    comm = SimpleNamespace(mesh=SimpleNamespace(device=torch.device("cpu")))
    two = table.kind("pipedream-2bw")
    assert pkgutil.resolve_name(two.runtime) is two_bw.make_runtime
    assert pkgutil.resolve_name(two.step) is TwoBWStep and issubclass(TwoBWStep, step_module.TrainStep)
    made = step_module.make_step(_parallel("pipedream-2bw"), None, comm, None)
    assert type(made) is TwoBWStep and made.runtime.on_update == made._update
    assert type(step_module.make_step(_parallel("1f1b"), None, comm, None)) is step_module.TrainStep
    assert type(step_module.make_step(SimpleNamespace(pipeline=None, scaler=None, grad_sync=None, meter=None),
                                      None, comm, None)) is step_module.TrainStep
    for name, k in table.SCHEDULES.items():  # every hook named resolves
        for hook in (k.runtime, k.step):
            assert hook is None or callable(pkgutil.resolve_name(hook)), (name, hook)
    # one entry is the whole change: the step it names is the one made
    entry = dataclasses.replace(table.SCHEDULES["gpipe"], step=f"{__name__}:RecordingStep")
    monkeypatch.setitem(table.SCHEDULES, "gpipe", entry)
    assert type(step_module.make_step(_parallel("gpipe"), None, comm, None)) is RecordingStep


def test_the_trainer_names_no_schedule_and_2bw_runs_the_shared_loop():
    trainer = (SRC / "train" / "trainer.py").read_text()
    assert not re.search(r"pipedream|two_bw|TwoBW|2bw", trainer)
    two_bw = (SRC / "pipeline" / "two_bw.py").read_text()
    # the posting loop lives once, in pipeline/runtime.py: 2BW's runtime defines none of its own
    assert "batch_send_recv" not in two_bw and "while i < n" not in two_bw and "def _post" not in two_bw
