"""bench/muon_convergence.py in a smoke run (3 steps, tiny batches): AdamW's tuned learning rate is the
one with the lowest final loss, the Muon runs really train with Muon (their losses leave AdamW's at the
same learning rate after the first step), and the plot is written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench():
    if "muon_convergence" not in sys.modules:
        spec = importlib.util.spec_from_file_location("muon_convergence", BENCH / "muon_convergence.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["muon_convergence"] = module
        spec.loader.exec_module(module)
    return sys.modules["muon_convergence"]


def test_the_tuned_adamw_rate_is_the_lowest_final_loss():
    curves = {("adamw", 1e-3, 0): [5.0, 4.0, 3.0], ("adamw", 3e-3, 0): [5.0, 3.0, 2.0],
              ("adamw", 1e-2, 0): [5.0, 3.5, 2.5], ("muon", 3e-3, 0): [5.0, 2.0, 1.0]}
    rows, tuned = bench().table(curves, window=2)
    assert tuned == 3e-3
    assert rows[("adamw", 1e-3)]["final"] == 3.5 and rows[("muon", 3e-3)]["final"] == 1.5


def test_a_smoke_run_trains_muon_and_plots(tmp_path):
    plot = tmp_path / "muon.png"
    out = bench().main(["--steps", "3", "--seeds", "1", "--adamw-lrs", "3e-3,1e-2", "--muon-lrs", "3e-3",
                        "--window", "2", "--batch", "2", "--seq", "32", "--plot", str(plot)])
    rows = out["rows"]
    adamw, muon = rows[("adamw", 3e-3)]["curves"][0], rows[("muon", 3e-3)]["curves"][0]
    assert len(muon) == 3 and muon[0] == adamw[0]  # the same model and batch at step 1
    assert muon[1:] != adamw[1:], "the muon runs trained with AdamW"
    assert out["tuned"] == min((3e-3, 1e-2), key=lambda lr: rows[("adamw", lr)]["final"])
    assert plot.stat().st_size > 0
