"""Parity cases run together and checked against one process: each world size runs all its cases
in one call of a `train_many` (tests/composition_tasks.py, tests/expert_tasks.py), and a case's
ranks are checked per step (loss, gradient norm) and per parameter, assembled from the placements;
where rounding differs by construction, on the update the steps made to the optimizer's fp32 values."""

from pathlib import Path

import torch

from tests.helpers import rel_err
from tests.zero_tasks import assemble


def run_by_world_size(worlds, train_many, cases: dict, root: Path) -> dict[str, list[dict]]:
    """cases: name -> (world size, overrides, reference overrides). Each case's per-rank results;
    case `name` of size s writes under `case_dir(cases, root, name)`."""
    out = {}
    for size in sorted({size for size, _, _ in cases.values()}):
        names = [n for n, (s, _, _) in cases.items() if s == size]
        per_rank = worlds(size).run(train_many, [(cases[n][1], str(case_dir(cases, root, n))) for n in names])
        out.update({name: [r[i] for r in per_rank] for i, name in enumerate(names)})
    return out


def case_dir(cases: dict, root: Path, name: str) -> Path:
    size = cases[name][0]
    return root / f"{size}-{[n for n, (s, _, _) in cases.items() if s == size].index(name)}"


def assert_steps_match(name: str, results: list[dict], ref: dict, tol: float, steps: int) -> None:
    """Every rank's per-step loss and gradient norm within `tol` of the reference's."""
    for r in results:
        assert len(r["losses"]) == len(ref["losses"]) == steps
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"]), 1):
            assert abs(a - b) <= tol * abs(b), f"{name} rank {r['rank']} step {step}: loss {a} vs {b}"
        for step, (a, b) in enumerate(zip(r["norms"], ref["norms"]), 1):
            assert abs(a - b) <= tol * abs(b), f"{name} rank {r['rank']} step {step}: grad norm {a} vs {b}"


def assert_parameters_match(name: str, results: list[dict], ref: dict, tol: float) -> None:
    """The ranks' parameters, assembled from their placements, cover the model and equal the reference's."""
    got = assemble([r["params"] for r in results], [r["placements"] for r in results])
    want = assemble([ref["params"]], [ref["placements"]])
    assert got.keys() == want.keys(), f"{name}: the ranks hold {sorted(got.keys() ^ want.keys())} wrongly"
    for key, value in want.items():
        assert not got[key].isnan().any(), f"{name}: {key} not covered by the placements"
        assert rel_err(got[key], value) <= tol, f"{name}: {key} differs by {rel_err(got[key], value):.2e}"


def update_error(got: dict, want: dict, initial: dict) -> tuple[float, str]:
    """The worst parameter's ||(got - initial) - (want - initial)|| / ||want - initial||: the error of
    what the steps changed, relative to the change (for one that did not change, e.g. a frozen base
    weight: ||got - want|| itself), and its name."""
    worst = (0.0, "")
    for key, value in want.items():
        moved = (value.double() - initial[key].double()).norm()
        diff = (got[key].double() - value.double()).norm()
        worst = max(worst, (float(diff / moved) if moved > 0 else float(diff), key))
    return worst


def fp32_values(results: list[dict]) -> dict[str, torch.Tensor]:
    """The global parameters as the optimizer holds them: its fp32 masters where it keeps any (bf16 and
    fp16 compute: the model holds a rounded copy, whose last bit hides a small update), else the model's."""
    params = assemble([r["params"] for r in results], [r["placements"] for r in results])
    masters = assemble([r["masters"] for r in results], [r["master_placements"] for r in results])
    return {name: masters.get(f"optimizer.master.{name}", value) for name, value in params.items()}
