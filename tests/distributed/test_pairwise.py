"""Every pair of composable options tried together (4 processes): an all-pairs covering of dp, tp,
pp with its schedule, sequence parallelism, ZeRO 0-3, remat policy, precision, gradient
compression, optimizer offload and the checkpoint mode (tests/pairwise.py builds it), each case
against one process.

fp32 cases without a lossy wire match one process within relative 1e-5 (loss per step and
every global parameter, reassembled through the placement contract). Cases that round
differently by construction - bf16/fp16 compute, whose rounding depends on how the work is
split, or a lossy gradient wire over dp > 1 - are compared with the one-process run of the
same precision within the looser bounds below. Pairs that can occur in no valid run are
configuration errors naming the key, checked without starting processes.

Every case saves at step SAVED and resumes from that checkpoint in a new run: under its own
layout (written synchronously, asynchronously, or read from the peer keepers' memory) the
resumed steps and final parameters equal the uninterrupted run's bitwise on every rank; under
another layout (one process, the case's precision) they match the one-process run within the
case's bounds, as the case itself does.
"""

import pytest

import torch

from tests.composition_tasks import train_and_resume, train_many
from tests.helpers import rel_err
from tests.pairwise import covering, case_with, invalid, invalid_pairs, label, overrides
from tests.zero_tasks import assemble
from threefold.checkpoint.format import step_dir_name
from threefold.config import load_config
from threefold.errors import ConfigError

STEPS = 3
SAVED = 2  # every case saves here (and at STEPS); its resume trains the steps after it again
BASE = ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=16", "train.lr=1e-3",
        "train.eps=1e-6", "train.grad_clip=0.5", "train.microbatches=2", f"train.steps={STEPS}",
        "run.progress=false", "run.plot=false"]
EXACT = 1e-5
# (loss, parameters) relative bounds. Low-precision compute against one process of that
# precision: the loss to a few bf16/fp16 ulps; parameters loosely (biases and norm gains start
# at 0 / 1, so a rounding difference in their few updates is a large relative one). A lossy
# wire (bf16 values; PowerSGD rank 4; ZeRO casts to it even at dp=1) against fp32 one process;
# DGC sends only the largest 0.1% of entries per step, so only the loss compares, loosely (by
# step 3 the one-process run has taken two full steps, DGC two of 0.1% of the entries).
LOOSE = {"bf16": (2e-2, 1e-1), "fp16": (5e-3, 1e-1), "bf16-wire": (2e-2, 5e-2), "powersgd": (2e-2, 5e-2),
         "dgc": (1e-1, float("inf"))}


def bounds(case: dict) -> tuple[float, float]:
    """The loosest bound of what the case does inexactly by construction (none: EXACT)."""
    causes = [case["precision"]] if case["precision"] != "fp32" else []
    if case["compress"] == "bf16" or (case["compress"] != "none" and case["dp"] > 1):
        causes.append("bf16-wire" if case["compress"] == "bf16" else case["compress"])
    return tuple(max(b) for b in zip((EXACT, EXACT), *(LOOSE[c] for c in causes)))


def test_invalid_pairs_are_config_errors():
    pairs = invalid_pairs()
    assert pairs, "the covering has no invalid pairs to check"
    for pair in pairs:
        case = case_with(pair)
        with pytest.raises(ConfigError) as err:
            load_config(None, BASE + overrides(case)).validate(4)
        assert err.value.field == invalid(case), f"{pair}: {err.value}"


def _jobs(cases: list[dict], root) -> tuple[list, list]:
    """(the 4-process runs with their same-layout resumes, the one-process resumes under another layout)."""
    runs, relayout = [], []
    for i, case in enumerate(cases):
        out = root / f"case{i}"
        options = BASE + overrides(case)
        resume = [f"checkpoint.resume={out / 'checkpoints' / step_dir_name(SAVED)}"]
        same = case["checkpoint"] != "relayout"
        runs.append((options + [f"checkpoint.save_every={SAVED}"], str(out),
                     (options + resume, f"{out}-resume") if same else None, case["checkpoint"] == "peer"))
        if not same:
            relayout.append((BASE + [f"precision.compute={case['precision']}"] + resume, f"{out}-resume"))
    return runs, relayout


def _same_layout_resume(case: dict, results: list[tuple]) -> str | None:
    """What differs between the resumed run and the uninterrupted one (bitwise, every rank), or None."""
    for first, resumed in results:
        if resumed["resumed_from"] != step_dir_name(SAVED):
            return f"rank {first['rank']} resumed from {resumed['resumed_from']}"
        if resumed["losses"] != first["losses"][SAVED:]:
            return (f"rank {first['rank']}: losses {resumed['losses']} after the resume, "
                    f"{first['losses'][SAVED:]} without")
        for key, value in first["params"].items():
            if not torch.equal(resumed["params"][key], value):
                return f"rank {first['rank']}: {key} differs after the resume"
    if case["checkpoint"] == "peer":
        loaded = [line for _, r in results for line in r["loaded"]]
        if not (loaded and loaded[0].endswith("file reads from peer memory, 0 from storage")):
            return f"not read from the keepers' memory: {loaded}"
    return None


def test_every_pair_of_options_matches_one_process(worlds, tmp_path, capsys):
    cases = covering()
    runs, relayout = _jobs(cases, tmp_path)
    per_rank = worlds(4).run(train_and_resume, runs)
    precisions = ("fp32", "bf16", "fp16")
    singles = worlds(1).run(train_many, [(BASE + [f"precision.compute={p}"], str(tmp_path / f"ref-{p}"))
                                         for p in precisions] + relayout)[0]
    refs, relayout_results = singles[:len(precisions)], iter(singles[len(precisions):])
    ref = {p: (r["losses"], assemble([r["params"]], [r["placements"]])) for p, r in zip(precisions, refs)}
    lines, failures = [], []
    for i, case in enumerate(cases):
        results = [r[i][0] for r in per_rank]
        want_losses, want = ref[case["precision"]]
        loss_bound, param_bound = bounds(case)
        loss_err = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], want_losses, strict=True))
        got = assemble([r["params"] for r in results], [r["placements"] for r in results])
        param_err, worst = max((rel_err(got[k], v), k) for k, v in want.items())
        if case["checkpoint"] == "relayout":  # resumed on one process: the steps after SAVED against one process
            resumed = next(relayout_results)
            resume_loss = max(abs(a - b) / abs(b) for a, b in zip(resumed["losses"], want_losses[SAVED:], strict=True))
            resume_param, resume_worst = max((rel_err(resumed["params"][k], v), k) for k, v in want.items())
            problem = None if resumed["resumed_from"] == step_dir_name(SAVED) else "not resumed"
            if resume_loss > loss_bound or resume_param > param_bound:
                problem = f"resumed: loss {resume_loss:.1e} params {resume_param:.1e} ({resume_worst})"
            resume_line = f"; resumed on one process: loss {resume_loss:.1e} params {resume_param:.1e}"
        else:
            problem = _same_layout_resume(case, [r[i] for r in per_rank])
            resume_line = "; resumed bitwise" if problem is None else ""
        lines.append(f"{label(case)}: loss {loss_err:.1e} params {param_err:.1e} ({worst}){resume_line}")
        if loss_err > loss_bound or param_err > param_bound or problem:
            failures.append(lines[-1] + (f"; {problem}" if problem else ""))
    with capsys.disabled():
        print(f"\n{len(cases)} cases cover every valid pair; relative error against one process, {STEPS} steps, "
              f"resumed from step {SAVED}:\n  " + "\n  ".join(lines))
    assert not failures, "\n".join(failures)


TIED_UNDER_PP = ["model.preset=tiny", "model.layers=4", "train.global_batch=8", "train.seq_len=16",
                 "train.lr=1e-3", "train.microbatches=2", "train.steps=3", "run.progress=false", "run.plot=false",
                 "parallel.dp=2", "parallel.pp=2", "pipeline.schedule=1f1b"]


@pytest.mark.parametrize("compress", [["compress.method=dgc"], ["compress.method=powersgd", "compress.warmup_steps=1"],
                                      ["compress.method=onebit", "compress.warmup_steps=1"],
                                      ["compress.method=onebit", "compress.onebit_adam=false"]])
def test_tied_weights_stay_one_under_pp_with_a_lossy_wire(worlds, tmp_path, compress):
    """The embedding (first stage) and the head (last stage) are one tied weight, held by both ends
    and saved once (at pp coordinate 0). Summed before the dp exchange, DGC / PowerSGD compressed
    them per bucket with per-rank residuals, and the two ends' buckets differ: each end applied
    another approximation of the same gradient, the copies drifted apart, and a resume (which loads
    the last stage's copy from the first stage's) was not the same run (the pairwise case dp=2
    pp=zb-h1 compress=dgc checkpoint=peer). Summed after it, both ends hold the same sum."""
    options = TIED_UNDER_PP + compress
    out = tmp_path / "run"
    resume = (options + [f"checkpoint.resume={out / 'checkpoints' / step_dir_name(SAVED)}"], str(tmp_path / "resumed"))
    per_rank = [r[0] for r in worlds(4).run(train_and_resume, [(options + [f"checkpoint.save_every={SAVED}"],
                                                                   str(out), resume, False)])]
    copies = {first["coords"]: first["params"].get("embed.tok.weight", first["params"].get("head.weight"))
              for first, _ in per_rank}
    assert torch.equal(copies[(0, 0, 0)], copies[(0, 0, 1)]), "the tied copies differ between the stages"
    assert _same_layout_resume({"checkpoint": "sync"}, per_rank) is None
