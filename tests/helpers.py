"""Functions that run on every rank of a test world (module level, so they can be pickled)."""

from __future__ import annotations

import torch

from threefold.config import Config, load_config


def make_config(overrides: list[str], out: str) -> Config:
    return load_config(None, [f"run.out={out}", "run.progress=false", "run.plot=false", *overrides])


def train_and_report(overrides: list[str], out: str) -> dict:
    """Train with `overrides`; return losses, grad norms, final parameters and per-step records."""
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    records = trainer.run()
    params = {name: p.detach().clone() for name, p in trainer.parallel.module.named_parameters()}
    return {"losses": [r["loss"] for r in records], "records": records, "params": params,
            "rank": trainer.mesh.global_rank}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference ||a - b|| / ||b|| in fp32 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm()
    return float((a - b).norm() / denom) if denom > 0 else float((a - b).norm())


def max_rel_err(params_a: dict, params_b: dict) -> tuple[float, str]:
    worst = max(((rel_err(params_a[k], params_b[k]), k) for k in params_b), default=(0.0, ""))
    return worst


def flat_pieces(param: torch.Tensor, grad: torch.Tensor, cuts: list[int]) -> list:
    """`param` as optimizer pieces: flat shards [0, cuts..., numel) with views of `grad`."""
    from threefold.parallel.master import Piece
    from threefold.sharding import Placement

    place = Placement.whole("w", tuple(param.shape))
    flat, gflat = param.view(-1), grad.view(-1)
    bounds = [0, *cuts, flat.numel()]
    return [Piece("w", place.flat_shard(a, b), flat[a:b], (lambda g=gflat[a:b]: g), True, a)
            for a, b in zip(bounds, bounds[1:])]
