"""Activation offload (`remat.offload=cpu`, parallel/remat.py): the same training, saved bytes moved.

Each layout trains the tiny model 6 steps without offload and with it (every block, and one block),
alone and under selective recomputation, in the shared worlds (one call per world size). Losses
and every parameter agree within relative 1e-5 (they are in fact bitwise equal: the copies move
bytes, the kernels are the same), and the device's saved-activation bytes (`mem.activations`:
what the hooks did not move) fall by exactly the host bytes (`mem.activations_host`) - the
offloaded blocks' share; the planner's prediction of both is checked in test_planner_memory.py.
"""

import pytest

from tests.helpers import max_rel_err, train_and_report

TINY = ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16", "train.steps=6"]
VARIANTS = {"none": [], "all": ["remat.offload=cpu"], "block1": ["remat.offload=cpu", "remat.offload_blocks=1"]}
LAYOUTS = {  # world size -> layout -> (overrides, the offload variants it runs besides none)
    1: {"dp1": ([], ("all", "block1")), "dp1-selective": (["remat.policy=selective"], ("all",))},
    2: {"tp2": (["parallel.tp=2"], ("all",)),
        "pp2-selective": (["parallel.pp=2", "train.microbatches=2", "remat.policy=selective"], ("block1",))},
}


def train_variants(layouts: dict, out: str) -> dict:
    return {(layout, variant): train_and_report([*TINY, *overrides, *VARIANTS[variant]], f"{out}/{layout}-{variant}")
            for layout, (overrides, variants) in layouts.items() for variant in ("none", *variants)}


@pytest.mark.parametrize("size", sorted(LAYOUTS))
def test_offload_trains_the_same_and_moves_the_blocks_share(worlds, tmp_path, size):
    for rank, runs in enumerate(worlds(size).run(train_variants, LAYOUTS[size], str(tmp_path))):
        for layout, (_, variants) in LAYOUTS[size].items():
            base = runs[(layout, "none")]
            moved = {}
            for variant in variants:
                run = runs[(layout, variant)]
                where = f"{layout} {variant} rank {rank}"
                worst = max(abs(a / b - 1) for a, b in zip(run["losses"], base["losses"]))
                assert worst <= 1e-5, f"{where}: losses {run['losses']} vs {base['losses']}"
                err, name = max_rel_err(run["params"], base["params"])
                assert err <= 1e-5, f"{where}: {name} differs by {err:.2e}"
                mem, before = run["records"][-1]["mem"], base["records"][-1]["mem"]
                assert "activations_host" not in before
                moved[variant] = mem["activations_host"]
                # rank 0 of pp2 holds block 0 only: offloading block 1 moves nothing there
                holds_block1 = not (layout.startswith("pp2") and rank == 0)
                assert moved[variant] > 0 or (variant == "block1" and not holds_block1), where
                assert mem["activations"] == before["activations"] - moved[variant], where
            if len(moved) == 2:  # two blocks of equal saves: one is half of both
                assert 2 * moved["block1"] == moved["all"], (layout, rank, moved)
