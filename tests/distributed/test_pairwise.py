"""Every pair of composable options tried together (4 processes): an all-pairs covering of dp, tp,
pp with its schedule, sequence parallelism, ZeRO 0-3, remat policy, precision (mxfp8 among them),
gradient compression, optimizer offload (host memory or NVMe files), LoRA, the checkpoint mode,
the optimizer (AdamW, Muon), multi-token prediction and experts balanced by an auxiliary loss or
a bias (tests/pairwise.py builds it), each case against one process of the same precision,
optimizer and model.

fp32 cases without a lossy wire match one process within relative 1e-5 (loss per step and
every global parameter, reassembled through the placement contract). Cases that round
differently by construction - bf16/fp16 compute, whose rounding depends on how the work is
split, or a lossy gradient wire over dp > 1 - are compared with the one-process run of the
same precision (and the same model: LoRA cases with one-process LoRA) within the bounds below,
on what the steps changed: per parameter, ||(final - initial) - (final_ref - initial)|| /
||final_ref - initial||, so a wrong update is as large an error as the update itself (the
parameters' own values would hide it: 3 AdamW steps move a weight by ~3e-3 of its ~2e-2).
DGC sends every entry here (compress.dgc_sparsity=0, no local clipping): its selection,
packing, exchange, error feedback and momentum masking must then give the dense sum of bf16
values, which one process computes independently. Pairs that can occur in no valid run are
configuration errors naming the key in one line, checked without starting processes.

Every case saves at step SAVED and resumes from that checkpoint in a new run: under its own
layout (written synchronously, asynchronously, or read from the peer keepers' memory) the
resumed steps and final parameters equal the uninterrupted run's bitwise on every rank; under
another layout (one process, the case's precision) they match the one-process run within the
case's bounds, as the case itself does.
"""

from pathlib import Path

import pytest
import torch

from tests.case_runs import fp32_values, update_error
from tests.composition_tasks import train_and_resume, train_many
from tests.helpers import rel_err
from tests.hf_moe_tasks import save_tiny_moe
from tests.hf_tasks import save_tiny
from tests.pairwise import covering, case_with, invalid, invalid_pairs, label, model, overrides, reference, training
from tests.zero_tasks import assemble
from threefold.checkpoint.format import step_dir_name
from threefold.config import load_config
from threefold.errors import ConfigError

STEPS = 3
SAVED = 2  # every case saves here (and at STEPS); its resume trains the steps after it again
BASE = ["train.global_batch=8", "train.seq_len=16", "train.lr=1e-3", "train.eps=1e-6", "train.grad_clip=0.5",
        "train.microbatches=2", f"train.steps={STEPS}", "run.progress=false", "run.plot=false"]
EXACT = 1e-5  # relative, on the parameters themselves (fp32 and an exact wire: the same sums in another order)
# (loss, update) relative bounds of what a case does inexactly by construction, against one
# process of the same precision and model, on the update of the optimizer's fp32 values
# (`update_error`). Low-precision compute: a layout sums partial products and gradients in
# another order, so they differ by a few roundings (bf16: 8 significant bits, 2^-8 = 3.9e-3
# relative per rounding; fp16: 11 bits, 4.9e-4), the loss by a few of them and the update of
# AdamW (m / sqrt(v): a relative gradient error passes into it about 1:1) by some more, 3 steps
# adding up (measured worst: bf16 8.3e-2, LoRA's B at tp=2; fp16 9.2e-3, its loss 1.2e-5). A bf16
# wire (bf16 compression, DGC sending bf16 values, ZeRO reducing in the compute dtype) rounds each
# rank's gradient once more (measured worst 6.0e-2: LoRA's A, which moves only from step 2 as B
# starts at 0). PowerSGD rank 4 sends a rank-4 approximation of each gradient matrix (the rest
# follows later through the error feedback): the loosest by construction (measured 1.9e-1, its
# loss 1.9e-3). MXFP8 rounds every operand of the blocks' matmuls to e4m3 (4 significant bits:
# 2^-4 = 6.3e-2 relative) under a scale per 32 values: a bf16 difference upstream moves an element
# across an e4m3 rounding boundary, and under dp the weight gradient's blocks along the tokens
# are other rows (measured worst 2.8e-1, LoRA's A at tp=2; its loss 1.3e-4). Muon orthogonalises
# each update matrix (Newton-Schulz towards U V^T): the directions of the gradient's small singular
# values are scaled up to the size of the large ones, and a rounding error with them, so any inexact
# gradient (low precision, a bf16 wire) moves its update by far more than AdamW's (measured worst
# 3.8e-1 under mxfp8, 2.5e-1 bf16, 1.4e-1 through a bf16 wire; fp32 with an exact wire stays
# within EXACT: 4.8e-7). A router of experts under bf16 compute: its gradient sums the differences
# of the experts' bf16 outputs weighted by the softmax's derivative (the gates sum to 1), nearly
# cancelling, so it keeps fewer correct bits than the rest (measured worst 1.3e-1, tp=2). A wrong
# update (a rank's gradient lost, a step skipped) is off by about the whole update: 1.
LOOSE = {"bf16": (1e-4, 1e-1), "fp16": (3e-5, 1.5e-2), "bf16-wire": (1e-4, 8e-2), "dgc": (1e-4, 8e-2),
         "powersgd": (4e-3, 2.5e-1), "mxfp8": (3e-4, 4e-1), "muon": (EXACT, 5e-1), "router": (1e-4, 2e-1)}


def bounds(case: dict) -> tuple[float, float]:
    """The loosest bound of what the case does inexactly by construction (none: EXACT)."""
    causes = [case["precision"]] if case["precision"] != "fp32" else []
    if case["compress"] == "bf16" or (case["compress"] != "none" and case["dp"] > 1):
        causes.append("bf16-wire" if case["compress"] == "bf16" else case["compress"])
    if case["optimizer"] == "muon" and causes:
        causes.append("muon")
    if case["moe"] != "none" and case["precision"] in ("bf16", "mxfp8"):  # mxfp8: bf16 around its matmuls
        causes.append("router")
    return tuple(max(b) for b in zip((EXACT, EXACT), *(LOOSE[c] for c in causes)))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The Hugging Face models LoRA cases adapt: a 4-layer Llama (2 per stage, or 1 per interleaved chunk) with
    4 key/value heads of 16 (whole 32-element MXFP8 blocks at tp=2); a Mixtral for LoRA with experts (refused)."""
    root = tmp_path_factory.mktemp("hf")
    return {"llama": str(save_tiny("llama", root / "llama", num_hidden_layers=4, num_key_value_heads=4)),
            "mixtral": str(save_tiny_moe("mixtral", root / "mixtral"))}


def test_invalid_pairs_are_config_errors(hf):
    """Each pair no valid case holds is refused when the config is validated, in one line naming the key."""
    pairs = invalid_pairs()
    assert (("zero", 0), ("offload", "nvme")) in pairs, pairs
    for pair in pairs:
        case = case_with(pair)
        with pytest.raises(ConfigError) as err:
            load_config(None, BASE + model(case, hf) + overrides(case)).validate(4)
        assert err.value.field == invalid(case), f"{pair}: {err.value}"
        assert "\n" not in str(err.value), f"{pair}: not one line: {err.value}"


def _jobs(cases: list[dict], root, hf: dict) -> tuple[list, list]:
    """(the 4-process runs with their same-layout resumes, the one-process resumes under another layout)."""
    runs, relayout = [], []
    for i, case in enumerate(cases):
        out = root / f"case{i}"
        options = BASE + model(case, hf)
        resume = [f"checkpoint.resume={out / 'checkpoints' / step_dir_name(SAVED)}"]
        same = case["checkpoint"] != "relayout"
        if case["offload"] == "nvme":  # the scratch directories must exist (parallel/scratch.py)
            for scratch in (f"{out}-nvme", f"{out}-resume-nvme"):
                Path(scratch).mkdir(parents=True)
        runs.append((options + overrides(case, f"{out}-nvme") + [f"checkpoint.save_every={SAVED}"], str(out),
                     (options + overrides(case, f"{out}-resume-nvme") + resume, f"{out}-resume") if same else None,
                     case["checkpoint"] == "peer"))
        if not same:
            relayout.append((options + training(case) + resume, f"{out}-resume"))
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


def parameter_error(got: dict, want: dict, initial: dict, exact: bool) -> tuple[float, str]:
    """An exact case: the worst parameter's relative error (an update's relative error would be
    bounded by the fp32 rounding of a value near 1, 1.2e-7 of a 3e-3 change); else `update_error`."""
    if exact:
        return max((rel_err(got[k], v), k) for k, v in want.items())
    return update_error(got, want, initial)


def _references(worlds, tmp_path, hf: dict, cases: list[dict]) -> dict:
    """{`reference(case)`: (losses, global parameters, initial parameters)} of one process for the keys the
    cases need (its precision, optimizer and model). Run before the cases: what a world returns holds a file
    descriptor per tensor until it is dropped, and the cases' results with these would pass the limit."""
    keys = {reference(case): case for case in cases}
    jobs = [(BASE + model(case, hf) + training(case), str(tmp_path / f"ref-{i}"))
            for i, case in enumerate(keys.values())]
    refs = {}
    for key, r in zip(keys, worlds(1).run(train_many, jobs, True)[0]):
        initial = fp32_values([{**r, "params": r["initial"], "masters": r["initial_masters"]}])  # as the masters start
        refs[key] = (r["losses"], fp32_values([r]), initial)
    return refs


def test_every_pair_of_options_matches_one_process(worlds, tmp_path, hf, capsys):
    cases = covering()
    runs, relayout = _jobs(cases, tmp_path, hf)
    refs = _references(worlds, tmp_path, hf, cases)
    per_rank = worlds(4).run(train_and_resume, runs)
    relayout_results = iter(worlds(1).run(train_many, relayout)[0])
    lines, failures = [], []
    for i, case in enumerate(cases):
        results = [r[i][0] for r in per_rank]
        want_losses, want, initial = refs[reference(case)]
        loss_bound, update_bound = bounds(case)
        loss_err = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], want_losses, strict=True))
        exact, what = update_bound == EXACT, "params" if update_bound == EXACT else "update"
        param_err, worst = parameter_error(fp32_values(results), want, initial, exact)
        if case["checkpoint"] == "relayout":  # resumed on one process: the steps after SAVED against one process
            resumed = next(relayout_results)
            resume_loss = max(abs(a - b) / abs(b) for a, b in zip(resumed["losses"], want_losses[SAVED:], strict=True))
            resume_param, resume_worst = parameter_error(fp32_values([resumed]), want, initial, exact)
            problem = None if resumed["resumed_from"] == step_dir_name(SAVED) else "not resumed"
            if resume_loss > loss_bound or resume_param > update_bound:
                problem = f"resumed: loss {resume_loss:.1e} {what} {resume_param:.1e} ({resume_worst})"
            resume_line = f"; resumed on one process: loss {resume_loss:.1e} {what} {resume_param:.1e}"
        else:
            problem = _same_layout_resume(case, [r[i] for r in per_rank])
            resume_line = "; resumed bitwise" if problem is None else ""
        lines.append(f"{label(case)}: loss {loss_err:.1e} {what} {param_err:.1e} ({worst}){resume_line}")
        if loss_err > loss_bound or param_err > update_bound or problem:
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
