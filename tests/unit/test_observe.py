"""Single-process checks of the debugging tools: hang report, statistics, traces, non-finite
detection, replica hashes, parameter reassembly, parity comparison, plots, config."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from threefold.comm.collectives import CollectiveRecord
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.observe.hang import Watchdog
from threefold.observe.hang_report import build_report, format_report
from threefold.observe.nonfinite import NonFiniteMonitor, decode_name, encode_name
from threefold.observe.params import load_global, owned_boxes
from threefold.train.parity import compare, parse_layouts
from threefold.observe.plots import plot_run
from threefold.observe.replicas import tensor_hash
from threefold.observe.stats import RunStats, blocked_seconds, split_step, straggler
from threefold.observe.trace import TraceRecorder
from threefold.sharding import Placement
from threefold.errors import UserError


def _call(seq, op="all_reduce", axis="dp", group=(0, 1, 2, 3), axis_seq=None, start=0.0, end=None, wait=None,
          peer=None, callsite="trainer.py:87"):
    return CollectiveRecord(seq, op, axis, (), "float32", 4, callsite, start, end, tuple(group),
                            axis_seq or seq, wait, peer)


def _dump(rank, in_flight=(), last=None, stack=("trainer.py:50 in run", "faults.py:66 in stall")):
    return {"rank": rank, "step": 3, "coords": {"pp": 0, "dp": rank, "tp": 0},
            "in_flight": [dict(c.to_dict(), in_flight_s=12.0) for c in in_flight],
            "last_completed": last.to_dict() if last else None, "stack": list(stack)}


def test_hang_report_names_who_never_joined_and_where_everyone_is(tmp_path):
    waiting = _call(6, "all_reduce.metrics", group=(0, 1, 2, 3, 4))
    for rank in (0, 1, 3):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(_dump(rank, [waiting])))
    (tmp_path / "rank-2.json").write_text(json.dumps(_dump(2, [], last=_call(5, "all_reduce.grad_norm", end=1.0))))
    report = build_report(tmp_path, 5, timeout_s=10)
    assert report["never_joined"] == [2, 4]  # rank 4 left no record at all
    assert report["missing"] == [4]
    (wait,) = report["waits"]
    assert wait["waiting"] == [0, 1, 3] and wait["op"] == "all_reduce.metrics" and wait["axis_seq"] == 6
    text = format_report(report)
    assert "ranks 0,1,3 wait in all_reduce.metrics on dp (call #6 on dp, seq 6" in text
    assert "never joined: ranks 2,4" in text
    assert "rank 2 (pp=0 dp=2 tp=0) step 3: not in a collective, at faults.py:66 in stall" in text
    assert "rank 4 () no flight record" in text


def test_a_rank_that_joined_the_overdue_call_late_waits_in_it_too(tmp_path):
    """The watchdog of the first rank past the limit asks every rank for its record; one that joined the
    same collective later has been in it for less than the limit, and still waits there (a loaded
    machine: ranks 0 and 3 were listed, rank 1 in the same call for 6.1 s of 6.2 was left out)."""
    waiting = _call(6, "all_reduce.metrics")
    for rank, seconds in ((0, 12.0), (1, 3.0), (3, 12.0)):
        dump = _dump(rank, [waiting])
        dump["in_flight"][0]["in_flight_s"] = seconds
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(dump))
    (tmp_path / "rank-2.json").write_text(json.dumps(_dump(2, [], last=_call(5, "all_reduce.grad_norm", end=1.0))))
    (wait,) = build_report(tmp_path, 4, timeout_s=10)["waits"]
    assert wait["waiting"] == [0, 1, 3] and wait["never_joined"] == [2] and wait["in_flight_s"] == 12.0
    # a rank in another call that is not overdue is not a wait
    other = _dump(1, [_call(7, "all_gather", axis="tp", group=(1, 3))])
    other["in_flight"][0]["in_flight_s"] = 3.0
    (tmp_path / "rank-1.json").write_text(json.dumps(other))
    (wait,) = build_report(tmp_path, 4, timeout_s=10)["waits"]
    assert wait["waiting"] == [0, 3]


def test_hang_report_matches_point_to_point_peers(tmp_path):
    recv = _call(9, "recv", axis="pp", group=(0, 1), peer=1)
    (tmp_path / "rank-0.json").write_text(json.dumps(_dump(0, [recv])))
    (tmp_path / "rank-1.json").write_text(json.dumps(_dump(1, [_call(9, "recv", axis="pp", group=(0, 1), peer=0)])))
    report = build_report(tmp_path, 2, timeout_s=10)
    # both receive from each other (a deadlock): each waits for a send the other never posts
    assert [(w["waiting"], w["never_joined"]) for w in report["waits"]] == [([0], [1]), ([1], [0])]
    (tmp_path / "rank-1.json").write_text(json.dumps(_dump(1, [_call(9, "send", axis="pp", group=(0, 1), peer=0)])))
    assert build_report(tmp_path, 2, timeout_s=10)["never_joined"] == []  # a matching send: only slow


class _FakeMesh:
    global_rank, world_size = 0, 1
    device = torch.device("cpu")

    def rank(self, axis):
        return 0

    def ranks(self, axis):
        return [0]


def test_watchdog_dumps_and_reports_a_collective_in_flight_too_long(tmp_path):
    comm = SimpleNamespace(mesh=_FakeMesh(), records=[_call(1, end=0.5), _call(2, group=(0,), start=time.monotonic())],
                           _axis_seq={"dp": 2}, poll=lambda: None)
    dog = Watchdog(comm, tmp_path, timeout_s=0.2, grace_s=1.0, poll_s=0.05, step=lambda: 7, exit_process=False)
    dog.start()
    deadline = time.monotonic() + 20
    while not (tmp_path / "hang-report.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert record["step"] == 7 and record["in_flight"][0]["seq"] == 2
    assert any("test_observe.py" in frame for frame in record["stack"])  # where the main thread was
    report = json.loads((tmp_path / "hang-report.json").read_text())
    assert report["waits"][0]["waiting"] == [0]
    assert (tmp_path / "hang-report.txt").read_text().startswith("threefold hang report")


def test_step_split_and_straggler():
    split = split_step([1.0, 1.0, 1.0], [0.6, 0.3, 0.7])
    assert split["compute_s"] == pytest.approx([0.4, 0.7, 0.3])
    assert split["idle_s"] == pytest.approx([0.3, 0.0, 0.4])  # waiting for rank 1, the slowest
    assert split["comm_s"] == pytest.approx([0.3, 0.3, 0.3])
    assert straggler([0.1, 0.1, 0.5, 0.1], 1.5) == 2
    assert straggler([0.1, 0.12, 0.11, 0.1], 1.5) is None
    assert straggler([0.3], 1.5) is None
    run = RunStats(1.5)
    for _ in range(3):
        run.add(split_step([1, 1, 1, 1], [0.9, 0.9, 0.1, 0.9]), 2)
    assert run.summary()["straggler"] == 2 and run.summary()["steps_flagged"] == {"2": 3}


def test_blocked_time_counts_only_waiting():
    records = [_call(1, start=0.0, end=1.0),  # before the step
               _call(2, start=10.0, end=10.5),  # blocking: issue to end
               _call(3, start=10.5, wait=11.5, end=11.75),  # async: overlapped until wait()
               _call(4, start=11.8)]  # still in flight
    assert blocked_seconds(records, since_seq=1) == pytest.approx(0.75)


def test_trace_has_compute_blocked_and_lanes_for_overlapping_calls(tmp_path):
    trace = TraceRecorder(0, "pp=0 dp=0 tp=0")
    calls = [_call(1, start=10.0, wait=10.6, end=10.8), _call(2, start=10.1, wait=10.8, end=10.9)]
    trace.add_step(1, 9.9, 11.0, calls)
    events = json.loads(trace.write(tmp_path / "rank-0.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    names = [e["name"] for e in slices]
    assert names.count("step 1") == 1 and "compute" in names and "blocked" in names
    comm_tids = {e["tid"] for e in slices if e["name"] == "all_reduce"}
    assert len(comm_tids) == 2  # the two calls overlap: two lanes
    blocked = sum(e["dur"] for e in slices if e["name"] == "blocked")
    compute = sum(e["dur"] for e in slices if e["name"] == "compute")
    assert blocked == pytest.approx(0.3e6, rel=1e-6) and compute == pytest.approx(0.8e6, rel=1e-6)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.inner(self.a(x)))


def test_nonfinite_monitor_names_the_innermost_first_module():
    model = _Tiny()
    monitor = NonFiniteMonitor(model)
    model(torch.randn(2, 4))
    assert monitor.first() is None
    monitor.reset()
    handle = model.inner[2].register_forward_hook(lambda m, i, out: out * float("inf"), prepend=True)
    model(torch.randn(2, 4))
    assert monitor.first() == "inner.2"  # not its parent "inner", nor "b" or "model" after it
    handle.remove()
    monitor.close()
    assert decode_name(encode_name("blocks.1.mlp.up")) == "blocks.1.mlp.up"


def test_tensor_hash_is_bit_exact():
    t = torch.randn(1000)
    u = t.clone()
    assert torch.equal(tensor_hash(t), tensor_hash(u))
    u[537] = torch.nextafter(u[537], torch.tensor(math.inf))  # one ulp
    assert not torch.equal(tensor_hash(t), tensor_hash(u))
    assert tensor_hash(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.int64


def test_parameters_reassemble_from_any_placement(tmp_path):
    from safetensors.torch import save_file

    full = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6)
    whole = Placement.whole("w", (5, 6))
    # tensor-parallel halves along dim 0 padded to 6 rows, then each half flat-sharded in two (ZeRO)
    files = []
    for half in range(2):
        box = whole.padded(0, 6).split(0, half, 2)
        padded = torch.zeros(6, 6)
        padded[:5] = full
        local_box = padded[half * 3:(half + 1) * 3].reshape(-1)
        for shard in range(2):
            place = box.flat_shard(shard * 9, (shard + 1) * 9)
            boxes = owned_boxes(local_box[shard * 9:(shard + 1) * 9], place)
            files.append({f"w@{','.join(map(str, s))}": v.contiguous() for s, v in boxes})
    for i, tensors in enumerate(files):
        save_file(tensors, str(tmp_path / f"rank-{i}.safetensors"), metadata={"global_shapes": json.dumps({"w": [5, 6]})})
    assert torch.equal(load_global(tmp_path)["w"], full)
    save_file(files[0], str(tmp_path / "rank-9.safetensors"), metadata={"global_shapes": json.dumps({"w": [5, 6]})})
    with pytest.raises(ValueError, match="more than once"):
        load_global(tmp_path)


def test_parity_compare_names_the_first_failing_step():
    ref = {"losses": [5.0, 4.0, 3.0], "params": {"w": torch.ones(4)}}
    same = {"losses": [5.0, 4.0 * (1 + 1e-7), 3.0], "params": {"w": torch.ones(4) * (1 + 1e-6)}}
    assert compare(ref, same, 1e-5, 1e-4)["failure"] is None
    off = {"losses": [5.0, 4.1, 3.2], "params": {"w": torch.ones(4)}}
    step, why = compare(ref, off, 1e-5, 1e-4)["failure"]
    assert step == 2 and "loss 4.1 vs 4" in why
    drift = {"losses": [5.0, 4.0, 3.0], "params": {"w": torch.tensor([1.0, 1.0, 1.0, 1.1])}}
    step, why = compare(ref, drift, 1e-5, 1e-4)["failure"]
    assert step == 3 and "parameter w" in why
    assert [(x.dp, x.tp, x.pp, x.cp) for x in parse_layouts("1,1,1 2,1,1")] == [(1, 1, 1, 1), (2, 1, 1, 1)]
    with pytest.raises(UserError, match="--layouts"):
        parse_layouts("1,1,1 2,x,1")


def test_plots_of_a_run(tmp_path):
    rows = [{"step": s, "loss": 5 - 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 1000 + s,
             "mem": {"params": 2**20, "peak": 3 * 2**20},
             "ranks": {"compute_s": [0.1, 0.3], "comm_s": [0.01, 0.01], "idle_s": [0.2, 0.0]}} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    written = plot_run(tmp_path / "metrics.jsonl", tmp_path)
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png", "ranks.png"]
    assert all(p.stat().st_size > 1000 for p in written)


@pytest.mark.parametrize("override, message", [
    ("debug.straggler_ratio=1", "debug.straggler_ratio: must exceed 1"),
    ("fault.layout=2,1", "fault.layout: '2,1' is not a layout"),
    ("fault.layout=2,1,1,0", "fault.layout: '2,1,1,0' is not a layout"),
    ("debug.hang_grace_s=0", "debug.hang_grace_s: must be positive"),
])
def test_debug_config_mistakes(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override]).validate(1)


def test_recorder_off_excludes_the_tools_that_need_it():
    with pytest.raises(ConfigError, match="debug.watchdog: needs the flight recorder"):
        load_config(None, ["debug.history=0"]).validate(1)
    load_config(None, ["debug.history=0", "debug.watchdog=false"]).validate(1)
    # a fault meant for another layout does not need its rank to exist here
    load_config(None, ["fault.rank=3", "fault.layout=4,1,1"]).validate(1)
    with pytest.raises(ConfigError, match="fault.rank"):
        load_config(None, ["fault.rank=3", "fault.layout=1,1,1"]).validate(1)


def test_a_fault_layout_tells_context_parallel_runs_apart():
    """fault.layout names cp too (dp,tp,pp[,cp]; cp 1 when not written): a fault for dp 2 does not fire in a
    run of dp 2 x cp 2, and one for 2,1,1,2 does."""
    from threefold.config.debug_checks import fault_applies
    from threefold.layout import Layout

    fault = load_config(None, ["fault.rank=0", "fault.layout=2,1,1"]).fault
    assert fault_applies(fault, Layout(dp=2)) and not fault_applies(fault, Layout(dp=2, cp=2))
    fault = load_config(None, ["fault.rank=0", "fault.layout=2,1,1,2"]).fault
    assert fault_applies(fault, Layout(dp=2, cp=2)) and not fault_applies(fault, Layout(dp=2))


def test_an_earlier_hang_report_survives_a_restart(tmp_path):
    from threefold.observe.hang import clear_flight_dir

    flight = tmp_path / "flight"
    flight.mkdir()
    (flight / "hang-report.json").write_text("{}")
    clear_flight_dir(flight)
    assert not flight.exists() and [p.name.startswith("flight.") for p in tmp_path.iterdir()] == [True]
    flight.mkdir()
    (flight / "rank-0.json").write_text("{}")  # records without a report: just removed
    clear_flight_dir(flight)
    assert len(list(tmp_path.iterdir())) == 1
