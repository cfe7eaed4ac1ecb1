"""The hang report: from every rank's flight record (DIR/flight/rank-N.json, written by the
watchdog), which collective the ranks wait in, which ranks never joined it, and where every
rank is.

A rank *joined* a collective another rank waits in when its own record shows the same call in
flight: same axis and group, and the same index among its calls on that axis (`axis_seq`;
every member of a group issues the group's collectives in the same order, so the n-th call of
one is the n-th call of the others). A send or receive waits for its peer only. Everything
else - a rank in a different call, computing, stalled, or without any record (dead, or holding
the interpreter lock) - *never joined*, and the report says where it is instead.
"""

from __future__ import annotations

import json
from pathlib import Path

_MATCHING_P2P = {"send": "recv", "recv": "send"}


def load_records(flight_dir: Path, world_size: int) -> dict[int, dict]:
    records = {}
    for rank in range(world_size):
        path = Path(flight_dir) / f"rank-{rank}.json"
        if path.exists():
            records[rank] = json.loads(path.read_text())
    return records


def _joined(member: dict | None, call: dict, waiter: int) -> bool:
    if member is None:
        return False
    for other in member["in_flight"]:
        if call["op"] in _MATCHING_P2P:
            if other["op"] == _MATCHING_P2P[call["op"]] and other["peer"] == waiter and other["axis"] == call["axis"]:
                return True
        elif (other["axis"], tuple(other["group"]), other["axis_seq"], other["op"]) == (
                call["axis"], tuple(call["group"]), call["axis_seq"], call["op"]):
            return True
    return False


def describe_call(call: dict) -> str:
    peer = f" with rank {call['peer']}" if call.get("peer") is not None else ""
    return (f"{call['op']} on {call['axis']}{peer} (call #{call['axis_seq']} on {call['axis']}, seq {call['seq']}, "
            f"shape {list(call['shape'])} {call['dtype']}) at {call['callsite']}")


def where(record: dict | None) -> str:
    """One line: what a rank is doing."""
    if record is None:
        return "no flight record (the process is gone or did not respond)"
    here = _innermost_threefold_frame(record["stack"])
    if record["in_flight"]:
        call = record["in_flight"][0]
        return f"step {record['step']}: in {describe_call(call)} for {call['in_flight_s']:.1f} s"
    last = record["last_completed"]
    after = f"; last finished: {last['op']} on {last['axis']} seq {last['seq']}" if last else ""
    return f"step {record['step']}: not in a collective, at {here}{after}"


def _innermost_threefold_frame(stack: list[str]) -> str:
    for frame in reversed(stack):
        if not frame.startswith(("threading.py", "hang.py")):
            return frame
    return "?"


def _wait_key(call: dict) -> tuple:
    return call["op"], call["axis"], tuple(call["group"]), call["axis_seq"], call.get("peer")


def build_report(flight_dir: Path, world_size: int, timeout_s: float) -> dict:
    records = load_records(flight_dir, world_size)
    # the oldest call of each rank is the one it is blocked on; a call is a wait once some rank has been in
    # it past the limit, and then every rank in it waits there, however late it joined (its own time shorter)
    oldest = {rank: record["in_flight"][0] for rank, record in records.items() if record["in_flight"]}
    overdue = {_wait_key(c) for c in oldest.values() if c["in_flight_s"] >= timeout_s}
    waits: dict[tuple, dict] = {}
    for rank, call in sorted(oldest.items()):
        key = _wait_key(call)
        if key in overdue:
            entry = waits.setdefault(key, {**{k: call[k] for k in ("op", "axis", "group", "axis_seq", "seq", "shape",
                                                                    "dtype", "callsite", "peer")},
                                           "waiting": [], "never_joined": [], "in_flight_s": call["in_flight_s"]})
            entry["waiting"].append(rank)
            entry["in_flight_s"] = max(entry["in_flight_s"], call["in_flight_s"])  # the longest wait in it
            members = [call["peer"]] if call["op"] in _MATCHING_P2P else call["group"]
            for member in members:
                if member != rank and not _joined(records.get(member), call, rank) \
                        and member not in entry["never_joined"]:
                    entry["never_joined"].append(member)
    waits_list = sorted(waits.values(), key=lambda w: -len(w["waiting"]))
    for entry in waits_list:
        entry["never_joined"] = sorted(set(entry["never_joined"]) - set(entry["waiting"]))
    never = sorted({r for w in waits_list for r in w["never_joined"]})
    return {
        "timeout_s": timeout_s, "world_size": world_size,
        "waits": waits_list, "never_joined": never,
        "missing": sorted(set(range(world_size)) - set(records)),
        "ranks": {str(r): {"where": where(records.get(r)), "coords": records[r]["coords"] if r in records else None,
                           "stack": records[r]["stack"] if r in records else []}
                  for r in range(world_size)},
    }


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def format_report(report: dict) -> str:
    lines = [f"threefold hang report: a collective was in flight longer than {report['timeout_s']:g} s"]
    for w in report["waits"]:
        lines.append(f"  {_ranks(w['waiting'])} wait in {describe_call(w)} (group {','.join(map(str, w['group']))})")
        if w["never_joined"]:
            lines.append(f"    never joined: {_ranks(w['never_joined'])}")
    if not report["waits"]:
        lines.append("  no rank was found waiting (the collective finished while the records were written)")
    if report["missing"]:
        lines.append(f"  no flight record from {_ranks(report['missing'])} (process gone or not responding)")
    lines.append("where every rank is:")
    for rank, info in report["ranks"].items():
        coords = " ".join(f"{a}={c}" for a, c in (info["coords"] or {}).items())
        lines.append(f"  rank {rank} ({coords}) {info['where']}")
    return "\n".join(lines) + "\n"
