"""Functions run on every rank of a test world for the expert-parallel tests (module level: picklable)."""

from __future__ import annotations

import contextlib
import io

import torch

from tests.helpers import make_config


def _count_routing(records: list):
    """A forward hook that re-routes the block's input with its own router (not the dispatch) and
    appends the kept assignments per global expert of this rank's tokens."""

    def hook(moe, inputs, output):
        if not torch.is_grad_enabled():  # evaluation: not a training step's routing
            return
        x = inputs[0].detach()
        probs = moe.router(x).float().softmax(-1)
        idx = probs.topk(moe.top_k, dim=-1).indices
        kept = idx[moe._keep(idx)]
        records.append(torch.bincount(kept, minlength=moe.num_experts).tolist())

    return hook


def train_experts(overrides: list[str], out: str) -> dict:
    """Train; return losses, norms, moe metrics, ep bytes and routing counts per step, the final
    local parameters with their placements and the ep group."""
    from threefold.models.moe import moe_modules
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        routing: list = []
        for _, moe in moe_modules(trainer.parallel.module):
            moe.register_forward_hook(_count_routing(routing))
        records = trainer.run()
    mesh = trainer.mesh
    blocks = len(moe_modules(trainer.parallel.module))
    steps = len(records)
    per_step = [routing[i * blocks:(i + 1) * blocks] for i in range(steps)] if routing else []
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "moe": [r.get("moe") for r in records],
            "a2a": [r["comm"].get("ep", {}).get("all_to_all", 0) for r in records], "routing": per_step,
            "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
            "placements": dict(trainer.parallel.placements), "rank": mesh.global_rank,
            "ep_group": mesh.ranks("ep"), "ep_rank": mesh.rank("ep"),
            "resumed_from": trainer.resumed_from.name if trainer.resumed_from else None,
            "coords": {a: mesh.rank(a) for a in ("pp", "dp", "tp", "ep")},
            "flight": [r.to_dict() for r in trainer.comm.records if r.op.startswith("all_to_all")][-2:],
            "overlap": trainer.parallel.pipeline.pair_overlap() if trainer.parallel.pipeline is not None else None}


def train_many(runs: list[tuple[list[str], str]]) -> list[dict]:
    return [train_experts(overrides, out) for overrides, out in runs]
