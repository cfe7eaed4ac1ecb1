"""Functions run on every rank of a test world for the ZeRO / precision tests, and their helpers."""

from __future__ import annotations

import math

import torch

from tests.helpers import make_config


def train_stages(runs: list[list[str]], out: str) -> list[dict]:
    """Train once per override list; report what the ZeRO tests check, per run."""
    from threefold.train.trainer import Trainer

    reports = []
    for overrides in runs:
        trainer = Trainer(make_config(overrides, out))
        records = trainer.run()
        sync = trainer.parallel.grad_sync
        report = {
            "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "skipped": [r["skipped"] for r in records], "comm": [r["comm"] for r in records],
            "mem": records[-1]["mem"],
            "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
            "placements": dict(trainer.parallel.placements),
            "dtypes": {p.dtype for p in trainer.parallel.module.parameters()},
        }
        if hasattr(sync, "peak_whole_numel"):
            report["peak_whole"] = sync.peak_whole_numel
            report["units"] = {u.name: sync.unit_numel(u) for u in sync.units}
            report["tied_units"] = [u.name for u in sync.units
                                    if sum(1 for h in sync.hooked if u in h.needs) > 1]
        reports.append(report)
        del trainer
    return reports


def assemble(per_rank: list[dict], placements: list[dict]) -> dict[str, torch.Tensor]:
    """The global parameters from every rank's local tensors, through the placement contract only."""
    out: dict[str, torch.Tensor] = {}
    for params, places in zip(per_rank, placements):
        for name, local in params.items():
            place = places[name]
            full = out.setdefault(place.name, torch.full(place.global_shape, float("nan")))
            flat, index = local.reshape(-1), 0
            for off, shape in place.boxes():
                n = math.prod(shape)
                full[tuple(slice(o, o + s) for o, s in zip(off, shape))] = flat[index: index + n].view(shape)
                index += n
    return out
