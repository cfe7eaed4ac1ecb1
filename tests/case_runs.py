"""Parity cases run together and checked against one process: each world size runs all its cases
in one call of a `train_many` (tests/composition_tasks.py, tests/expert_tasks.py), and a case's
ranks are checked per step (loss, gradient norm) and per parameter, assembled from the placements."""

from pathlib import Path

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
