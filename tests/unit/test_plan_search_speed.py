"""The search made cheaper without changing its answers (issue 54: the whole search for 16,384 GPUs under 10 s).

The figures below were recorded with the search as it was before the schedule graph (planner/makespan.py), the
cached schedules and the pruning by `makespan_floor`: the best layout, its throughput and memory, and a digest of
every family's row (label, fits, tokens/s and memory to 9 digits). The work is bounded by the number of layouts
priced in full, not by a clock."""

import hashlib
import json
import random

import pytest

from threefold.config import load_config
from threefold.pipeline.simulate import Costs, simulate
from threefold.planner.hardware import PRESETS
from threefold.planner.makespan import makespan
from threefold.planner.search import SEARCHED, search
from threefold.planner.step_time import makespan_floor
from threefold.planner.workload import Workload
from threefold.schedules.registry import SCHEDULES, build_schedule, check

H100 = PRESETS["h100-80gb"]


def workload(preset, batch, seq=None):
    m = load_config(None, [f"model.preset={preset}"]).model
    return Workload(m, batch, seq or m.max_seq)


def digest(r) -> str:
    rows = [(c.strategy.label(), c.fits, f"{c.tokens_per_s:.9g}", f"{c.memory.total:.9g}", f"{c.hpz_bytes:.9g}")
            for c in r.candidates]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


# (workload, gpus, fixed): enumerated, best, tokens/s, memory bytes, digest of all families, most layouts priced
RECORDED = {
    "llama-70b on 16384": ((("llama-70b", 1024), 16384, None), 2992, "dp=128 tp=8 pp=16 zero=0 m=8 ckpt=none zb-h1 sp",
                           6507701.62, 2.20607005e10, "9a351e91d1342459", 2300),
    "llama-405b on 8192, tp 8": ((("llama-405b", 2048, 8192), 8192, {"tp": 8}), 2432,
                                 "dp=32 tp=8 pp=32 zero=1 m=64 ckpt=every-k zb-v sp", 1269132.52, 7.42493626e10,
                                 "8e6c1f1cb6eed1c1", 2600),
    "llama-7b at 32k on 4 (cp)": ((("llama-7b", 8, 32768), 4, None), 3296,
                                  "dp=1 tp=1 pp=1 cp=4 cp_method=ring zero=2 m=8 ckpt=every-k", 20711.6271,
                                  7.9581756e10, "c4a9c1a3e851a3ed", 3400),
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_the_search_finds_what_it_found_before(name):
    (args, gpus, fixed), evaluated, best, tps, mem, rows, most = RECORDED[name]
    r = search(workload(*args), gpus, H100, fixed)
    assert r.evaluated == evaluated
    assert r.best.strategy.label() == best
    assert r.best.tokens_per_s == pytest.approx(tps, rel=1e-8)
    assert r.best.memory.total == pytest.approx(mem, rel=1e-8)
    assert digest(r) == rows  # every family's best member and figures, not only the winner
    assert 0 < r.priced <= most  # the pruning by makespan_floor: fewer layouts priced in full


def test_the_pruning_skips_layouts_at_16384_gpus():
    r = search(workload("llama-70b", 1024), 16384, H100)
    # without the floor every fitting layout was priced: 3,269 (its 2,992 plus the families' refinements)
    assert r.priced < 0.75 * 3269


def _shapes():
    for name in SEARCHED:
        for p in (2, 3, 4, 8):
            for m in (1, 2, 4, 8, 12, 16):
                for v in (1, 2, 4):
                    vv = v if SCHEDULES[name].needs_virtual_stages else 1
                    if vv == v and not check(name, p, m, vv):
                        yield name, p, m, vv


def test_the_graph_makespan_is_the_simulators_to_the_bit_and_the_floor_is_below_it():
    rng = random.Random(54)
    for name, p, m, v in _shapes():
        s = build_schedule(name, p, m, v)
        for _ in range(2):
            f, b, w = (rng.uniform(1e-3, 3.0) for _ in range(3))  # per micro-batch and rank, w within b
            w = min(w, b)
            per = (f / s.virtual, (b - w) / s.virtual, w / s.virtual)
            simulated = simulate(s, Costs(*per)).makespan
            assert makespan(s, *per) == simulated, (name, p, m, v)
            assert makespan_floor(p, m, s.virtual, f, b) <= simulated * (1 + 1e-12), (name, p, m, v)
