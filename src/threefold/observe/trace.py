"""Per-rank Chrome trace (open in https://ui.perfetto.dev or chrome://tracing).

DIR/trace/rank-N.json holds, for rank N (one process in the viewer):
  * "steps"            one slice per optimizer step
  * "compute"          the step minus the time the main thread was blocked in collectives
  * "blocked"          the time blocked waiting for communication (a blocking call, or wait())
  * "<axis> comm k"    each collective from issue to completion, one lane per overlapping call,
                       with op, bytes, shape, sequence number and call site as arguments
DIR/trace/all.json merges every rank's file (written by rank 0 at the end of the run).
Times are wall-clock microseconds (monotonic clock anchored once), so ranks line up. The last
`max_steps` steps are kept.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path


class TraceRecorder:
    def __init__(self, rank: int, label: str, max_steps: int = 1000):
        self.rank = rank
        self.label = label
        self._offset = time.time() - time.monotonic()
        # (step, start, end, the step's CollectiveRecords); records are kept by reference
        self.steps: collections.deque = collections.deque(maxlen=max_steps)

    def add_step(self, step: int, start: float, end: float, records) -> None:
        self.steps.append((step, start, end, list(records)))

    def _us(self, t: float) -> float:
        return round((t + self._offset) * 1e6, 3)

    def events(self) -> list[dict]:
        pid = self.rank
        events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {self.rank} ({self.label})"}},
                  {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": self.rank}}]
        tids: dict[str, int] = {}

        def tid(name: str) -> int:
            if name not in tids:
                tids[name] = len(tids)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[name], "args": {"name": name}})
            return tids[name]

        for track in ("steps", "compute", "blocked"):
            tid(track)
        calls = sorted((c for *_, records in self.steps for c in records if c.end is not None), key=lambda c: c.start)
        for step, start, end, records in self.steps:
            events.append(_slice(f"step {step}", pid, tid("steps"), self._us(start), self._us(end)))
            blocked = sorted((c.wait if c.wait is not None else c.start, c.end) for c in records
                             if c.end is not None and c.end <= end)
            cursor = start
            for b0, b1 in blocked:
                if b0 > cursor:
                    events.append(_slice("compute", pid, tid("compute"), self._us(cursor), self._us(b0)))
                events.append(_slice("blocked", pid, tid("blocked"), self._us(max(b0, cursor)), self._us(b1)))
                cursor = max(cursor, b1)
            if end > cursor:
                events.append(_slice("compute", pid, tid("compute"), self._us(cursor), self._us(end)))
        lanes: dict[str, list[float]] = {}
        for c in calls:  # a lane per overlapping call on the same axis: slices on one track must nest
            ends = lanes.setdefault(c.axis, [])
            lane = next((i for i, e in enumerate(ends) if e <= c.start), len(ends))
            if lane == len(ends):
                ends.append(c.end)
            ends[lane] = c.end
            events.append(_slice(c.op, pid, tid(f"{c.axis} comm {lane}"), self._us(c.start), self._us(c.end),
                                 {"seq": c.seq, "bytes": c.bytes, "shape": list(c.shape), "dtype": c.dtype,
                                  "group": list(c.group), "callsite": c.callsite}))
        return events

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"}))
        return path


def _slice(name: str, pid: int, tid: int, ts: float, end: float, args: dict | None = None) -> dict:
    event = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": round(max(0.0, end - ts), 3)}
    if args:
        event["args"] = args
    return event


def merge_traces(paths: list[Path], out: Path) -> Path:
    """One trace with every rank's events (each rank is its own process in the viewer)."""
    events = []
    for path in paths:
        events.extend(json.loads(Path(path).read_text())["traceEvents"])
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
