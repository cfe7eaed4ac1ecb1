"""Experiment trackers through their own libraries: Weights & Biases and MLflow (`run.trackers`).

The writing rank's `MetricsLog` (train/metrics.py) hands each tracker every metrics.jsonl record,
and at the end the run's summary and plots; the resolved config goes first. Each tracker has its
own thread and queue, so a step never waits for one: `put` only appends to the queue. A tracker
that raises costs one warning line and is dropped for the rest of the run; one that hangs is left
behind after a bounded wait at close (`CLOSE_WAIT_S`), with one warning line. metrics.jsonl is
written before any tracker sees a record, so it is complete either way.

Where each library writes is its own setting: WANDB_MODE / WANDB_PROJECT / WANDB_DIR (default: the
run directory), MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME (docs/observe.md). TensorBoard stays in
MetricsLog as before (`run.tensorboard=true` is `tensorboard` in `run.trackers`).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Protocol

from ..config.installed import chosen

__all__ = ["CLOSE_WAIT_S", "Trackers", "chosen", "flat"]

CLOSE_WAIT_S = 60.0  # at close: how long all trackers together may take to send what is queued and finish


def flat(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record at any depth, their key paths joined by "/" (mem/peak,
    comm/dp/all_reduce); true / false as 1 / 0; text is left to metrics.jsonl."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, (bool, int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(flat(value, name + "/"))
        elif isinstance(value, list):
            out.update(flat({str(i): v for i, v in enumerate(value)}, name + "/"))
    return out


class Tracker(Protocol):
    name: str

    def start(self, config: dict, out: Path) -> None: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, summary: dict, plots: list[Path]) -> None: ...


class WandbTracker:
    """A Weights & Biases run: the config, one history row per step, the summary and the plots as images."""

    name = "wandb"

    def start(self, config: dict, out: Path) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "threefold"), name=out.name, config=config,
                               dir=os.environ.get("WANDB_DIR") or str(out), reinit="create_new",
                               settings=wandb.Settings(console="off"))  # threefold's streams stay its own

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def finish(self, summary: dict, plots: list[Path]) -> None:
        self._run.summary.update(summary)
        if plots:
            self._run.log({f"plots/{p.stem}": self._wandb.Image(str(p)) for p in plots})
        self._run.finish()


class MlflowTracker:
    """An MLflow run through MlflowClient (no process-wide active run): the config as params and
    config.json, metrics per step, the summary as tags, the plots as artifacts under plots/."""

    name = "mlflow"

    def start(self, config: dict, out: Path) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()  # MLFLOW_TRACKING_URI
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "threefold")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        self._run_id = client.create_run(experiment_id, run_name=out.name,
                                         tags={"threefold.run_dir": str(out)}).info.run_id
        params = [Param(f"{section}.{key}", json.dumps(value) if isinstance(value, (list, dict)) else str(value))
                  for section, values in config.items() for key, value in values.items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            client.log_batch(self._run_id, params=params[i:i + 100])
        client.log_dict(self._run_id, config, "config.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + 1000])

    def finish(self, summary: dict, plots: list[Path]) -> None:
        for key, value in summary.items():
            self._client.set_tag(self._run_id, f"summary.{key}", str(value))
        for plot in plots:
            self._client.log_artifact(self._run_id, str(plot), "plots")
        self._client.set_terminated(self._run_id)


MAKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def _warn(name: str, what: str) -> None:
    print(f"threefold: tracker {name}: {what} (metrics.jsonl is complete)", file=sys.stderr, flush=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= 240 else line[:237] + "..."


class _Worker:
    """One tracker on its own daemon thread: calls run in the order queued; the first that raises
    costs one warning line and the tracker is dropped."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.failed = tracker, False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"threefold-tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def put(self, method: Literal["start", "log", "finish"], *args) -> None:
        """Queue `tracker.method(*args)`: a method of the Tracker protocol, named for the warning line."""
        if not self.failed:
            self._jobs.put((method, args))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            method, args = job
            if self.failed:
                continue
            try:
                getattr(self.tracker, method)(*args)
            except BaseException as error:  # a tracker never takes the run down
                self.failed = True
                _warn(self.tracker.name, f"{method} failed: {_first_line(error)}")

    def close(self, deadline: float) -> None:
        self._jobs.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and not self.failed:
            self.failed = True
            _warn(self.tracker.name, f"did not finish within {CLOSE_WAIT_S:g} s; left behind")


class Trackers:
    """The trackers of `names` (wandb, mlflow; tensorboard is MetricsLog's own), each started on its
    thread with the resolved config; `log` and `finish` only queue."""

    def __init__(self, names: Iterable[str], config: dict, out: Path, makers: dict | None = None):
        makers = makers or MAKERS
        self._workers = [_Worker(makers[name]()) for name in names if name in makers]
        for worker in self._workers:
            worker.put("start", config, out)

    def __bool__(self) -> bool:
        return bool(self._workers)

    def log(self, record: dict) -> None:
        if self._workers:
            values = flat({k: v for k, v in record.items() if k != "step"})
            for worker in self._workers:
                worker.put("log", record["step"], values)

    def close(self, summary: dict, plots: list[Path]) -> None:
        """Queue the summary and plots, then wait for every tracker at most CLOSE_WAIT_S in all."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        for worker in self._workers:
            worker.put("finish", summary, plots)
        for worker in self._workers:
            worker.close(deadline)
