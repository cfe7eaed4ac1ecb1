"""Functions run on every rank of a test world for the composition tests (module level: picklable)."""

from __future__ import annotations

import contextlib
import io


from tests.helpers import make_config


def train_layout(overrides: list[str], out: str, initial: bool = False) -> dict:
    """Train; return losses, grad norms, the final local parameters with their placements (and
    with `initial`, the parameters and the optimizer's fp32 masters before the first step)."""
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        before = ({n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()}
                  if initial else None)
        masters_before = ({place.name: t.detach().float().clone() for place, t in trainer.optimizer.named_state()
                           if place.name.startswith("optimizer.master.")} if initial else None)
        records = trainer.run()
        trainer.parallel.settle()  # a reader after the run (ZeRO-3 with nvme left the shards in their file)
    mesh = trainer.mesh
    masters = [(place, t) for place, t in trainer.optimizer.named_state()
               if place.name.startswith("optimizer.master.")]  # bf16 / fp16 compute: the fp32 values
    return {"initial": before, "initial_masters": masters_before,
            "masters": {place.name: t.detach().float().clone() for place, t in masters},
            "master_placements": {place.name: place for place, _ in masters},
            "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "val": [r["val_loss"] for r in records if "val_loss" in r],
            "mem": records[-1]["mem"] if records else None,
            "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
            "placements": dict(trainer.parallel.placements),
            "coords": (mesh.rank("dp"), mesh.rank("tp"), mesh.rank("pp")), "rank": mesh.global_rank,
            "resumed_from": trainer.resumed_from.name if trainer.resumed_from else None,
            "loaded": [line for line in err.getvalue().splitlines() if line.startswith("threefold: loaded")]}


def train_many(runs: list[tuple[list[str], str]], initial: bool = False) -> list[dict]:
    """Several trainings in one world task (one round trip to the processes)."""
    return [train_layout(overrides, out, initial) for overrides, out in runs]


@contextlib.contextmanager
def own_keeper():
    """A peer-copy keeper of this rank's own, as if every rank were a node (the launcher's job)."""
    import os

    from threefold.checkpoint.peer import Keeper

    keeper = Keeper()
    os.environ.update(keeper.environment())  # its address and secret, as the launcher hands them on
    try:
        yield keeper
    finally:
        keeper.close()
        for name in keeper.environment():
            del os.environ[name]


def train_and_resume(runs: list[tuple[list[str], str, tuple[list[str], str] | None, bool]]) -> list[tuple]:
    """Each run, then its resume (overrides, out) when it has one, in one world task; `peer`: both
    with a keeper of this rank's own. Returns (run, resumed or None) per run."""
    out = []
    for overrides, run_out, resume, peer in runs:
        with own_keeper() if peer else contextlib.nullcontext():
            first = train_layout(overrides, run_out)
            out.append((first, train_layout(*resume) if resume is not None else None))
    return out
