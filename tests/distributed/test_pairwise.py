"""Every pair of composable options tried together (4 processes): an all-pairs covering of dp, tp,
pp with its schedule, sequence parallelism, ZeRO 0-3, remat policy, precision, gradient
compression and optimizer offload (tests/pairwise.py builds it), each case against one process.

fp32 cases without a lossy wire match one process within relative 1e-5 (loss per step and
every global parameter, reassembled through the placement contract). Cases that round
differently by construction - bf16/fp16 compute, whose rounding depends on how the work is
split, or a lossy gradient wire over dp > 1 - are compared with the one-process run of the
same precision within the looser bounds below. Pairs that can occur in no valid run are
configuration errors naming the key, checked without starting processes.
"""

import pytest

from tests.composition_tasks import train_many
from tests.helpers import rel_err
from tests.pairwise import covering, case_with, invalid, invalid_pairs, label, overrides
from tests.zero_tasks import assemble
from threefold.config import load_config
from threefold.errors import ConfigError

STEPS = 3
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


def test_every_pair_of_options_matches_one_process(worlds, tmp_path, capsys):
    cases = covering()
    jobs = [(BASE + overrides(c), str(tmp_path / f"case{i}")) for i, c in enumerate(cases)]
    per_rank = worlds(4).run(train_many, jobs)
    refs = worlds(1).run(train_many, [(BASE + [f"precision.compute={p}"], str(tmp_path / f"ref-{p}"))
                                      for p in ("fp32", "bf16", "fp16")])[0]
    ref = {p: (r["losses"], assemble([r["params"]], [r["placements"]])) for p, r in zip(("fp32", "bf16", "fp16"), refs)}
    lines, failures = [], []
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        want_losses, want = ref[case["precision"]]
        loss_err = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], want_losses, strict=True))
        got = assemble([r["params"] for r in results], [r["placements"] for r in results])
        param_err, worst = max((rel_err(got[k], v), k) for k, v in want.items())
        loss_bound, param_bound = bounds(case)
        lines.append(f"{label(case)}: loss {loss_err:.1e} params {param_err:.1e} ({worst})")
        if loss_err > loss_bound or param_err > param_bound:
            failures.append(lines[-1])
    with capsys.disabled():
        print(f"\n{len(cases)} cases cover every valid pair; relative error against one process, {STEPS} steps:\n  "
              + "\n  ".join(lines))
    assert not failures, "\n".join(failures)
