"""pipedream-2bw has no wait at a step boundary (pp = 2, gloo, CPU): its metrics reduction over pp
is posted asynchronously and read one step later (train/two_bw_step.py `TwoBWStep.reduce_figures`).

The last stage is slowed (a sleep before each of its forwards and backwards, a test hook on its
stage computation), so a rank that waited for it at a step boundary would show it. Measured from
the runtime's own timeline (every compute action of every step) and from Comm's flight record:

* at every boundary without a flush, the first stage starts step k + 1 before the last stage has
  finished step k (with a blocking reduction the first stage would wait for the last stage's end
  of step k: its first action would start after it);
* on every rank, no collective over pp blocks between the last compute action of step k and the
  first of step k + 1: each one issued there is waited for only after step k + 1 has begun;
* nothing is lost: the run is stopped by a signal to the last stage (SIGTERM's path, in process)
  after a checkpoint in the middle, and metrics.jsonl holds every step up to the step it saved,
  once each, in order, the same records the ranks returned.
"""

import json
import signal
import time

import pytest

from threefold.checkpoint.format import step_dir_name
from tests.helpers import make_config

SLOW_S = 0.05  # the last stage's sleep before each forward and backward
STEPS = 8  # the stop signal arrives in step STOP_IN: the world stops (and saves) one step later
STOP_IN = 5
SAVE_EVERY = 3  # a drain (the flush before the save) between steps 3 and 4
BASE = ["model.preset=tiny", "model.layers=4", "model.tie_embeddings=false", "train.global_batch=4",
        "train.seq_len=16", "train.microbatches=2", "train.grad_clip=0", "parallel.pp=2",
        "pipeline.schedule=pipedream-2bw", f"train.steps={STEPS}", f"checkpoint.save_every={SAVE_EVERY}"]


def _slowed(fn):
    def slow(*args):
        time.sleep(SLOW_S)
        return fn(*args)

    return slow


def slowed_run(overrides: list[str], out: str) -> dict:
    """Train with the last stage slowed and a stop signal to it in step STOP_IN; per step, the span of
    this rank's compute actions (time.monotonic's clock) and Comm's records."""
    from threefold.train.preempt import Preempted, StopSignals
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out), stop=StopSignals())
    runtime = trainer.parallel.pipeline
    last = trainer.mesh.rank("pp") == trainer.mesh.size("pp") - 1
    if last:
        runtime.compute.forward = _slowed(runtime.compute.forward)
        runtime.compute.backward = _slowed(runtime.compute.backward)
    spans = []  # (step, first compute start, last compute end); the drains are not steps
    inner = runtime.forward_backward
    shift = time.monotonic() - time.perf_counter()  # the runtime's clock (perf_counter) onto Comm's

    def recorded(micro_batches, global_tokens):
        loss = inner(micro_batches, global_tokens)
        compute = [e for e in runtime.timeline if e.kind in ("F", "B")]
        spans.append((len(spans) + 1, compute[0].start + shift, compute[-1].end + shift))
        if last and len(spans) == STOP_IN:
            trainer.stop.receive(signal.SIGTERM)
        return loss

    runtime.forward_backward = recorded
    stopped_at = None
    try:
        trainer.run()
    except Preempted as stop:
        stopped_at = stop.step
    return {"pp": trainer.mesh.rank("pp"), "spans": spans, "stopped_at": stopped_at,
            "records": [r.to_dict() for r in trainer.comm.records]}


@pytest.fixture(scope="module")
def slowed(worlds, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_bw_async")
    results = worlds(2).run(slowed_run, BASE, str(out))
    return {r["pp"]: r for r in results}, out


def _boundaries(stopped_at: int) -> list[int]:
    """The steps k whose boundary to k + 1 has no flush: not a save's (the drain), not the last."""
    return [k for k in range(1, stopped_at) if k % SAVE_EVERY]


def test_the_first_stage_starts_a_step_before_the_last_stage_ends_the_previous_one(slowed):
    by_pp, _ = slowed
    first, last = by_pp[0], by_pp[1]
    stopped_at = first["stopped_at"]
    assert stopped_at == STOP_IN + 1 == last["stopped_at"]
    assert len(first["spans"]) == len(last["spans"]) == stopped_at
    ahead = {k: last["spans"][k - 1][2] - first["spans"][k][1] for k in _boundaries(stopped_at)}
    # the last stage's last backward of step k is still running (it sleeps SLOW_S first) when the
    # first stage begins step k + 1; a boundary wait would make every figure negative
    assert all(lead > 0 for lead in ahead.values()), f"last stage's end of step k - first stage's start of k + 1: {ahead}"


def test_no_blocking_collective_over_pp_at_a_step_boundary(slowed):
    by_pp, _ = slowed
    for pp, result in by_pp.items():
        spans = result["spans"]
        collectives = [r for r in result["records"] if r["axis"] == "pp" and r["op"] not in ("send", "recv")]
        posted = 0
        for k in _boundaries(result["stopped_at"]):
            gap_start, gap_end = spans[k - 1][2], spans[k][1]
            inside = [r for r in collectives if gap_start <= r["start"] <= gap_end]
            assert inside, f"pp={pp}: no metrics reduction between steps {k} and {k + 1}"
            for r in inside:
                assert r["wait"] is not None and r["wait"] > gap_end, \
                    f"pp={pp}: {r['op']} ({r['callsite']}) blocked between steps {k} and {k + 1}"
                assert r["op"] == "all_reduce.metrics"
            posted += len(inside)
        assert posted == len(_boundaries(result["stopped_at"]))  # one reduction per step, nothing else


def test_every_step_is_written_once_up_to_the_stop(slowed):
    by_pp, out = slowed
    stopped_at = by_pp[0]["stopped_at"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 1))
    assert (out / "checkpoints" / step_dir_name(stopped_at)).is_dir()  # the stop's save
    # the first step after a flush (the start, the drain of the save at step 3) applies no update
    assert [r["grad_norm"] == 0.0 and r["lr"] == 0.0 for r in rows] == [s in (1, SAVE_EVERY + 1)
                                                                       for s in range(1, stopped_at + 1)]
    assert all(r["loss"] > 0 and not r["skipped"] for r in rows)


# ---------------------------------------------------------------- clipping by each stage's own norm

CLIP = 0.05  # below every stage's gradient norm here: every update is clipped, stage by stage
CLIP_STEPS = 4


def clipped_reference(overrides: list[str], out: str, stages: list[list[str]]) -> dict:
    """One process, the delayed update by hand (tests/distributed/test_two_bw.py), each stage's part of
    the gradient scaled by min(1, CLIP / (its own norm + 1e-6)) before the plain SGD step."""
    import torch

    from threefold.data.loader import bound_ids
    from threefold.train.optim import lr_at
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    cfg, model, names = trainer.cfg, trainer.parallel.module, trainer.parallel.placements
    tokens = cfg.train.global_batch * cfg.train.seq_len
    named = [(names[n].name, q) for n, q in model.named_parameters() if q.requires_grad]
    versions = [{n: q.detach().clone() for n, q in named}]
    losses, norms = [], []
    first = globally = None  # the first gradient applied, clipped stage by stage / by the global norm
    for s in range(1, CLIP_STEPS + 1):
        micro_batches, _ = bound_ids(trainer.loader.get(s - 1)[0], cfg.model.vocab)
        with torch.no_grad():
            for n, q in named:
                q.copy_(versions[max(s - 2, 0)][n])
                q.grad = None
        total = 0.0
        for mb in micro_batches:
            loss_sum = model(mb.inputs, mb.targets)
            (loss_sum / tokens).backward()
            total += loss_sum.item()
        grads = {n: q.grad.detach().clone() for n, q in named}
        losses.append(total / tokens)
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item())
        if globally is None:
            globally = {n: g * min(1.0, CLIP / (norms[-1] + 1e-6)) for n, g in grads.items()}
        for stage in stages:
            norm = torch.sqrt(sum(grads[n].double().square().sum() for n in stage if n in grads))
            coef = min(1.0, CLIP / (float(norm) + 1e-6))
            for n in stage:
                if n in grads:
                    grads[n] = grads[n] * coef
        first = grads if first is None else first
        lr = lr_at(s, cfg.train)
        versions.append({n: versions[-1][n] - lr * grads[n] for n, _ in named})
    trainer.loader.close()
    return {"losses": losses, "norms": norms, "params": versions[-1], "first": first, "globally": globally}


def test_clipping_is_by_each_stage_s_own_norm(worlds, tmp_path):
    from tests.distributed.test_two_bw import BASE as PLAIN, two_bw_run
    from tests.helpers import rel_err

    base = [o for o in PLAIN if not o.startswith(("train.grad_clip", "train.steps"))] + [
        f"train.grad_clip={CLIP}", f"train.steps={CLIP_STEPS}", "train.microbatches=2"]
    results = worlds(2).run(two_bw_run, base + ["parallel.pp=2", "pipeline.schedule=pipedream-2bw"],
                            str(tmp_path / "2bw"))
    stages = [sorted(r["params"]) for r in sorted(results, key=lambda r: r["pp"])]
    ref = worlds(1).run(clipped_reference, base, str(tmp_path / "ref"), stages)[0]
    last = next(r for r in results if r["pp"] == 1)
    for s in range(1, CLIP_STEPS + 1):
        assert abs(last["losses"][s - 1] - ref["losses"][s - 1]) <= 1e-5 * ref["losses"][s - 1], f"step {s}: loss"
    for s in range(2, CLIP_STEPS + 1):  # the norm before clipping, of the gradient applied at step s
        assert abs(last["norms"][s - 1] - ref["norms"][s - 2]) <= 1e-5 * ref["norms"][s - 2], f"step {s}: norm"
        assert ref["norms"][s - 2] > 2 * CLIP  # clipped at every update
    for r in results:
        for name, value in r["params"].items():
            if name in ref["params"]:
                assert rel_err(value, ref["params"][name]) <= 1e-5, f"pp={r['pp']}: parameter {name}"
    # the rule is not the synchronous one: clipping the first update by the global norm moves the weights elsewhere
    assert max(rel_err(g, ref["globally"][n]) for n, g in ref["first"].items()) > 0.1
