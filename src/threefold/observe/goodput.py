"""Goodput: where a run's wall time went, per attempt and across the attempts of one run directory.

Each attempt (a process world that trained in the directory: the first start, an automatic
restart, a `--resume` after a preemption) adds a record to DIR/goodput.json (JSON, written by the
writing rank, replaced atomically); the step-level figures are the lines of DIR/metrics.jsonl
(`step_time_s`, `data_wait_s`, `eval_time_s`, `save_stall_s`, `save_wait_s`, `time`). A record:

    attempt       1, 2, ...
    started_at    Unix time the trainer started (before the model is built)
    startup_s     seconds from then to the launch of its first step (build, load, checks)
    resumed_step  the step it started from (0: the beginning)
    outcome       running | completed | preempted | failed (an exception) | killed (no end written:
                  closed by the next attempt)
    ended_at      Unix time its files were closed (absent when killed: then its last line's `time`)
    checkpoint_s  the wait for the last save at the end; preemption_s: the save made on a stop signal
    lost          its step lines that the next attempt recomputed (it resumed from an older step):
                  read from metrics.jsonl by the next attempt before it drops them

`breakdown(doc, lines)` splits each attempt's wall time into CATEGORIES:

    productive  the steps' own time (step_time_s), less the rest of this list
    warmup      compile / warm-up: how much longer the first WARMUP_STEPS steps of an attempt took
                than the median of its later steps
    startup     the first attempt's startup_s
    data_wait   data_wait_s (inside step_time_s: the step waited for its batch)
    evaluation  eval_time_s
    checkpoint  save_stall_s (the save after a step, its blocking part when async), save_wait_s (a
                step's update waiting for an async snapshot) and the final wait for the last save
    recomputed  every second of the lost lines (steps done again after a resume from an older checkpoint)
    restart     a later attempt's startup_s, and the time from a failed or killed attempt's end to the
                next attempt's start (detection, relaunch)
    preemption  the save on a stop signal and the time from a preempted attempt's end to the next start
    other       the rest of the wall time: logging, the host between steps, the end's files

The wall time is each attempt's (started_at to its end) plus the gaps counted above; the time
after a completed attempt until another one starts (a later continuation) is nobody's and not
counted. Times are the writing rank's. Plain Python (no torch): `threefold runs goodput` reads it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

GOODPUT_FILE = "goodput.json"
METRICS_FILE = "metrics.jsonl"
CATEGORIES = ("productive", "warmup", "startup", "data_wait", "evaluation", "checkpoint", "recomputed", "restart",
              "preemption", "other")
LABELS = {"productive": "productive", "warmup": "warm-up", "startup": "startup", "data_wait": "data wait",
          "evaluation": "evaluation", "checkpoint": "checkpoint", "recomputed": "recomputed", "restart": "restart",
          "preemption": "preemption", "other": "other"}
WARMUP_STEPS = 2
STEP_KEYS = ("step", "step_time_s", "data_wait_s", "eval_time_s", "save_stall_s", "save_wait_s", "time")


def read_lines(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl (a line cut short by a killed writer is skipped)."""
    lines = []
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                lines.append(record)
    return lines


def read_goodput(out: Path) -> dict:
    """DIR/goodput.json, or an empty document (none, or unreadable)."""
    try:
        doc = json.loads((out / GOODPUT_FILE).read_text())
    except (OSError, ValueError):
        return {"version": 1, "attempts": []}
    return doc if isinstance(doc, dict) and isinstance(doc.get("attempts"), list) else {"version": 1, "attempts": []}


def _write(out: Path, doc: dict) -> None:
    path = out / GOODPUT_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _num(line: dict, key: str) -> float:
    value = line.get(key)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _attempt_seconds(attempt: dict, kept: list[dict], first: bool) -> dict[str, float]:
    """The categories of one attempt's own time (not the gap after it), `other` not yet."""
    s = dict.fromkeys(CATEGORIES, 0.0)
    s["startup" if first else "restart"] += _num(attempt, "startup_s")
    s["checkpoint"] += _num(attempt, "checkpoint_s")
    s["preemption"] += _num(attempt, "preemption_s")
    lost = attempt.get("lost") or []
    steps = sorted(kept + lost, key=lambda line: line["step"])
    compute = [_num(x, "step_time_s") - _num(x, "data_wait_s") - _num(x, "save_wait_s") for x in steps]
    later = compute[WARMUP_STEPS:] or compute
    reference = statistics.median(later) if later else 0.0
    lost_steps = {line["step"] for line in lost}
    for i, (line, c) in enumerate(zip(steps, compute)):
        if line["step"] in lost_steps:
            s["recomputed"] += _num(line, "step_time_s") + _num(line, "eval_time_s") + _num(line, "save_stall_s")
            continue
        excess = max(0.0, c - reference) if i < WARMUP_STEPS else 0.0
        s["warmup"] += excess
        s["productive"] += c - excess
        s["data_wait"] += _num(line, "data_wait_s")
        s["evaluation"] += _num(line, "eval_time_s")
        s["checkpoint"] += _num(line, "save_stall_s") + _num(line, "save_wait_s")
    return s


def _end(attempt: dict, lines: list[dict]) -> float:
    """When an attempt ended: its written end, else its last line's time, else the end of its startup."""
    if isinstance(attempt.get("ended_at"), (int, float)):
        return float(attempt["ended_at"])
    times = [_num(line, "time") for line in lines if _num(line, "time") > 0]
    return max(times) if times else _num(attempt, "started_at") + _num(attempt, "startup_s")


def breakdown(doc: dict, lines: list[dict]) -> dict:
    """{"attempts": [per attempt: attempt, outcome, steps, wall_s, seconds], "total": {wall_s, seconds,
    fractions}} from goodput.json's document and metrics.jsonl's lines (see the module docstring)."""
    attempts = sorted(doc.get("attempts", []), key=lambda a: a.get("attempt", 0))
    rows, total = [], dict.fromkeys(CATEGORIES, 0.0)
    wall_total = 0.0
    for i, attempt in enumerate(attempts):
        after = attempts[i + 1] if i + 1 < len(attempts) else None
        low = attempt.get("resumed_step", 0)  # its lines: up to the oldest step a later attempt resumed from
        high = min((a.get("resumed_step", 0) for a in attempts[i + 1:]), default=float("inf"))
        kept = [line for line in lines if low < line["step"] <= high]
        s = _attempt_seconds(attempt, kept, i == 0)
        end = _end(attempt, kept + (attempt.get("lost") or []))
        wall = max(0.0, end - _num(attempt, "started_at"))
        s["other"] = max(0.0, wall - sum(s.values()))
        wall = max(wall, sum(s.values()))
        if after is not None and attempt.get("outcome") != "completed":
            gap = max(0.0, _num(after, "started_at") - end)
            s["preemption" if attempt.get("outcome") == "preempted" else "restart"] += gap
            wall += gap
        steps = [line["step"] for line in kept]
        rows.append({"attempt": attempt.get("attempt", i + 1), "outcome": attempt.get("outcome", "running"),
                     "steps": [min(steps), max(steps)] if steps else None,
                     "recomputed_steps": [line["step"] for line in attempt.get("lost") or []],
                     "wall_s": wall, "seconds": s})
        wall_total += wall
        for key, value in s.items():
            total[key] += value
    fractions = {k: (v / wall_total if wall_total > 0 else 0.0) for k, v in total.items()}
    return {"attempts": rows, "total": {"wall_s": wall_total, "seconds": total, "fractions": fractions}}


def run_breakdown(out: Path) -> dict:
    """The breakdown of the run in `out` (its goodput.json and metrics.jsonl)."""
    return breakdown(read_goodput(out), read_lines(out / METRICS_FILE))


def summary_line(result: dict) -> str | None:
    """One line: the productive fraction of the wall time, then every other category that took time."""
    total = result["total"]
    if not result["attempts"] or total["wall_s"] <= 0:
        return None
    n = len(result["attempts"])
    parts = [f"goodput {total['fractions']['productive']:.1%} of {total['wall_s']:.3g} s "
             f"({n} attempt{'s' if n > 1 else ''})"]
    parts += [f"{LABELS[k]} {total['seconds'][k]:.3g} s ({total['fractions'][k]:.1%})" for k in CATEGORIES[1:]
              if total["seconds"][k] > 0]
    return ", ".join(parts)


class AttemptRecord:
    """The trainer's side: this attempt's record in DIR/goodput.json (only the writing rank writes).

    Made when the trainer starts; `begin(step)` before the first step (closes the previous attempt:
    its step lines after `step` are its lost ones, and are dropped from metrics.jsonl, which this
    attempt writes again); `end(outcome)` when the files are closed."""

    def __init__(self, out: Path, writer: bool, started_at: float, started: float):
        self.out, self.writer = out, writer
        self.started_at, self.started = started_at, started  # time.time() and time.perf_counter() at the start
        self.waits = {"checkpoint": 0.0, "preemption": 0.0}  # the final wait for the last save; a stop's save
        self._doc: dict | None = None  # goodput.json's document, from begin() on (the writer's)

    def add(self, category: str, seconds: float) -> None:
        """Seconds of this attempt outside its steps: "checkpoint" (the end's wait for the last save) or
        "preemption" (the save on a stop signal, and the wait for it)."""
        self.waits[category] += seconds

    def begin(self, step: int) -> None:
        if not self.writer:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        metrics = self.out / METRICS_FILE
        lines = read_lines(metrics)
        lost = [{k: line[k] for k in STEP_KEYS if k in line} for line in lines if line["step"] > step]
        if lost:  # the lines a crashed attempt wrote past the checkpoint this one resumes from
            metrics.write_text("".join(json.dumps(line) + "\n" for line in lines if line["step"] <= step))
        doc = read_goodput(self.out)
        if doc["attempts"]:
            previous = doc["attempts"][-1]
            previous["lost"] = lost
            if previous.get("outcome") == "running":
                previous["outcome"] = "killed"
        doc["attempts"].append({"attempt": len(doc["attempts"]) + 1, "started_at": self.started_at,
                                "startup_s": time.perf_counter() - self.started, "resumed_step": step,
                                "outcome": "running"})
        self._doc = doc
        _write(self.out, doc)

    def end(self, outcome: str) -> None:
        if not self.writer or self._doc is None:
            return
        record = self._doc["attempts"][-1]
        record.update({"outcome": outcome, "ended_at": time.time(),
                       **{f"{k}_s": v for k, v in self.waits.items()}})
        self._doc["summary"] = breakdown(self._doc, read_lines(self.out / METRICS_FILE))["total"]
        _write(self.out, self._doc)
