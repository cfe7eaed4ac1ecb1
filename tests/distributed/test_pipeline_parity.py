"""Pipeline parallelism against the single-process reference (gloo, CPU).

Every schedule x p in {2, 4} x m in {1, 4, 8} runs once (interleaved needs m >= p: its m = 1
is a config error, tested in unit/test_schedule_split.py); one case per schedule runs the
full 8 steps, the others 4 steps to keep the suite fast. Compared per step: loss and
gradient norm; at the end, per tensor: parameters and gradients, by global name.
"""

import pytest

from tests.helpers import make_config, rel_err

# eps=1e-6: see test_data_parallel.py (AdamW would turn rounding noise of ~0 gradients into steps)
BASE = ["model.preset=tiny", "model.layers=8", "train.global_batch=8", "train.seq_len=16", "train.lr=1e-3",
        "train.eps=1e-6"]
TOL = 1e-5


def train_and_collect(overrides: list[str], out: str) -> dict:
    """Train; return per-step losses and norms, and final parameters and gradients by global name."""
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    records = trainer.run()
    parallel, mesh = trainer.parallel, trainer.mesh
    params, grads = {}, {}
    for name, p in parallel.module.named_parameters():
        global_name = parallel.placements[name].name
        params[global_name] = p.detach().clone()
        if p.requires_grad:
            grads[global_name] = p.grad.detach().clone()
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "params": params,
            "grads": grads, "pp": mesh.rank("pp"), "dp": mesh.rank("dp"),
            "activations": trainer.memory()["activations"]}


@pytest.fixture(scope="module")
def reference(worlds, tmp_path_factory):
    cache = {}

    def get(steps: int, m: int, extra: tuple = ()) -> dict:
        key = (steps, m, extra)
        if key not in cache:
            overrides = BASE + [f"train.steps={steps}", f"train.microbatches={m}", *extra]
            cache[key] = worlds(1).run(train_and_collect, overrides, str(tmp_path_factory.mktemp("ref")))[0]
        return cache[key]

    return get


def check(results: list[dict], ref: dict, label: str) -> None:
    for r in results:
        where = f"{label} pp={r['pp']} dp={r['dp']}"
        assert len(r["losses"]) == len(ref["losses"])
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"]), 1):
            assert abs(a - b) <= TOL * abs(b), f"{where} step {step}: loss {a} vs {b}"
        for step, (a, b) in enumerate(zip(r["norms"], ref["norms"]), 1):
            assert abs(a - b) <= TOL * abs(b), f"{where} step {step}: grad norm {a} vs {b}"
        for name, value in r["params"].items():
            assert rel_err(value, ref["params"][name]) <= TOL, f"{where}: parameter {name}"
        for name, value in r["grads"].items():
            assert rel_err(value, ref["grads"][name]) <= TOL, f"{where}: gradient {name}"
    held = set().union(*(r["params"] for r in results))
    assert held == set(ref["params"]), f"{label}: stages hold {sorted(held ^ set(ref['params']))} wrongly"
    # a weight tied across the first and last stage takes identical steps on both
    for name in ("embed.tok.weight",):
        copies = [r["params"][name] for r in results if name in r["params"] and r["dp"] == 0]
        assert all((c == copies[0]).all() for c in copies), f"{label}: copies of {name} diverged"


def _case(schedule, p, m, steps):
    return pytest.param(schedule, p, m, steps, id=f"{schedule}-p{p}-m{m}-{steps}steps")


CASES = [
    # one longer run per schedule
    _case("gpipe", 2, 8, 8), _case("1f1b", 4, 8, 8), _case("interleaved", 4, 8, 8), _case("zb-h1", 4, 4, 8),
    # the rest of schedule x p x m
    _case("gpipe", 2, 1, 4), _case("gpipe", 2, 4, 4), _case("gpipe", 4, 1, 4), _case("gpipe", 4, 4, 4),
    _case("gpipe", 4, 8, 4),
    _case("1f1b", 2, 1, 4), _case("1f1b", 2, 4, 4), _case("1f1b", 2, 8, 4), _case("1f1b", 4, 1, 4),
    _case("1f1b", 4, 4, 4),
    _case("interleaved", 2, 4, 4), _case("interleaved", 2, 8, 4), _case("interleaved", 4, 4, 4),
    _case("zb-h1", 2, 1, 4), _case("zb-h1", 2, 4, 4), _case("zb-h1", 2, 8, 4), _case("zb-h1", 4, 1, 4),
    _case("zb-h1", 4, 8, 4),
]


@pytest.mark.parametrize("schedule, p, m, steps", CASES)
def test_pipeline_matches_single_process(worlds, tmp_path, reference, schedule, p, m, steps):
    v = 2 if schedule == "interleaved" else 1
    overrides = BASE + [f"train.steps={steps}", f"train.microbatches={m}", f"parallel.pp={p}",
                        f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}"]
    results = worlds(p).run(train_and_collect, overrides, str(tmp_path))
    check(results, reference(steps, m), f"{schedule} p={p} m={m}")


@pytest.mark.parametrize("schedule, p, m", [("gpipe", 2, 4), ("1f1b", 2, 4), ("zb-h1", 2, 4), ("interleaved", 2, 4),
                                            ("interleaved", 4, 8)])
def test_pipeline_parity_under_nccl_semantics(worlds, tmp_path, reference, schedule, p, m):
    """Comm as NCCL behaves: one Work per p2p batch, batches of an axis in issue order."""
    v = 2 if schedule == "interleaved" else 1
    overrides = BASE + ["train.steps=4", f"train.microbatches={m}", f"parallel.pp={p}", "debug.comm_semantics=nccl",
                        f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}"]
    results = worlds(p).run(train_and_collect, overrides, str(tmp_path))
    check(results, reference(4, m), f"{schedule} p={p} m={m} under NCCL semantics")


def test_activation_memory_follows_the_schedule(worlds, tmp_path):
    """Bytes autograd held at the peak, per rank: GPipe m micro-batches, 1F1B p - rank."""
    held = {}
    for schedule in ("gpipe", "1f1b"):
        overrides = BASE + ["train.steps=1", "train.microbatches=8", "parallel.pp=2", f"pipeline.schedule={schedule}"]
        held[schedule] = [r["activations"] for r in worlds(2).run(train_and_collect, overrides, str(tmp_path))]
    assert held["gpipe"][0] == 4 * held["1f1b"][0]  # 8 micro-batches against 2
    assert held["gpipe"][1] == 8 * held["1f1b"][1]  # 8 against 1


def test_explicit_split_and_time_balance(worlds, tmp_path, reference):
    for extra in (["pipeline.split=3"], ["pipeline.balance=time"]):
        overrides = BASE + ["train.steps=4", "train.microbatches=4", "parallel.pp=2", "pipeline.schedule=1f1b", *extra]
        results = worlds(2).run(train_and_collect, overrides, str(tmp_path))
        check(results, reference(4, 4), " ".join(extra))


def test_untied_llama_variant(worlds, tmp_path, reference):
    extra = ("model.preset=tiny-llama", "model.layers=4")
    overrides = BASE + ["train.steps=4", "train.microbatches=4", "parallel.pp=2", "pipeline.schedule=zb-h1", *extra]
    results = worlds(2).run(train_and_collect, overrides, str(tmp_path))
    check(results, reference(4, 4, extra), "tiny-llama zb-h1")


@pytest.mark.parametrize("schedule, m, steps", [("1f1b", 4, 8), ("zb-h1", 2, 4), ("interleaved", 2, 4)])
def test_data_times_pipeline_parallel(worlds, tmp_path, reference, schedule, m, steps):
    v = 2 if schedule == "interleaved" else 1
    overrides = BASE + [f"train.steps={steps}", f"train.microbatches={m}", "parallel.pp=2", "parallel.dp=2",
                        f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={v}"]
    if schedule == "1f1b":
        overrides.append("run.plot=true")  # also exports the measured timeline
    results = worlds(4).run(train_and_collect, overrides, str(tmp_path))
    # each dp replica runs m micro-batches of 8 / (2 m) sequences: the reference runs 2 m of them
    check(results, reference(steps, 2 * m), f"dp=2 x pp=2 {schedule}")
    if schedule == "1f1b":
        assert (tmp_path / "pipeline.png").stat().st_size > 1000
        assert (tmp_path / "pipeline-trace.json").stat().st_size > 100
