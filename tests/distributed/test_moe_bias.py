"""Auxiliary-loss-free balancing (`model.router_balance=bias`) against a plain PyTorch reference written here.

The reference shares only the decoder's initial weights and the token batches with threefold; its
mixture of experts is written out below (softmax scores, the top k of scores + bias, the gate weights
from the unbiased scores renormalised over the k, every expert computed densely), with DeepSeek-V3's
sequence-wise balance loss, momentum-free SGD and the bias rule b_e += rate x sign(mean load - load_e)
over the whole global batch after each step. threefold under (1,1,1), ep2, dp2 x ep2 ZeRO-1, tp2 ep2,
pp2 ep2 and cp2 ep2 matches it within 1e-5 per tensor (loss, every parameter), and every rank's copy of
every block's bias equals the reference's exactly.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import make_config, rel_err
from tests.zero_tasks import assemble
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model

STEPS, TOL = 4, 1e-5
BASE = ["model.preset=tiny-moe", "train.global_batch=8", "train.seq_len=16", f"train.steps={STEPS}",
        "train.optimizer=sgd", "train.lr=0.5", "train.momentum=0", "train.weight_decay=0", "train.grad_clip=0",
        "train.min_lr_ratio=1.0", "train.warmup_steps=0", "model.router_z_weight=0",
        "model.router_balance=bias", "model.router_bias_rate=0.01", "model.router_seq_aux_weight=0.01"]
LAYOUTS = {"ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
           "dp2 ep2 zero1": (4, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"]),
           "tp2 ep2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"]),
           "pp2 ep2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "train.microbatches=2"]),
           "cp2 ep2": (4, ["parallel.dp=2", "parallel.ep=2", "parallel.cp=2"])}


class PlainBiasMoE(nn.Module):
    """A mixture of experts with bias routing, written out: no threefold code."""

    def __init__(self, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, k: int):
        super().__init__()
        self.router, self.w_gate = nn.Parameter(router.clone()), nn.Parameter(w_gate.clone())
        self.w_up, self.w_down = nn.Parameter(w_up.clone()), nn.Parameter(w_down.clone())
        self.bias, self.k = torch.zeros(router.shape[0]), k
        self.load = torch.zeros(router.shape[0])  # assignments per expert this step
        self.balance = torch.zeros(())  # this forward's mean balance loss over sequences
        self.flips = 0  # assignments the bias moved to another expert

    def forward(self, x):  # (b, s, h)
        e = self.router.shape[0]
        probs = (x @ self.router.t()).softmax(-1)
        idx = (probs + self.bias).topk(self.k, -1).indices
        self.flips += int((idx.sort(-1).values != probs.topk(self.k, -1).indices.sort(-1).values).any(-1).sum())
        gate = probs.gather(-1, idx)
        gate = gate / gate.sum(-1, keepdim=True)
        every = torch.stack([(F.silu(x @ self.w_gate[j].t()) * (x @ self.w_up[j].t())) @ self.w_down[j].t()
                             for j in range(e)])  # (e, b, s, h): each expert on every token
        picked = every.permute(1, 2, 0, 3).gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))
        chosen = F.one_hot(idx, e).sum(2).float()  # (b, s, e)
        self.load += chosen.sum((0, 1))
        f = chosen.mean(1) / self.k  # (b, e): the fraction of each sequence's assignments
        self.balance = (e * (f * probs.mean(1)).sum(-1)).mean()
        return (gate.unsqueeze(-1) * picked).sum(2)


def reference_run(overrides: list[str]) -> dict:
    cfg = make_config(overrides, "unused")
    t, m = cfg.train, cfg.model
    model = build_model(m, t.seed)
    plain = []
    for block in model.blocks:
        moe = block.mlp
        block.mlp = PlainBiasMoE(moe.router.weight.detach(), moe.experts.w_gate.detach(), moe.experts.w_up.detach(),
                                 moe.experts.w_down.detach(), m.experts_top_k)
        plain.append(block.mlp)
    sampler = Sampler(load_tokens(cfg.data.source, m.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    optimizer = torch.optim.SGD(list(model.parameters()), lr=t.lr)
    losses, biases = [], []
    for step in range(STEPS):
        batch = sampler.step_batch(step)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
        loss = loss + m.router_seq_aux_weight * sum(p.balance for p in plain)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for p in plain:  # after the update: b_e += rate x sign(mean load - load_e)
            p.bias += m.router_bias_rate * (p.load.mean() - p.load).sign()
            p.load.zero_()
        losses.append(float(loss.detach()))
        biases.append([p.bias.clone() for p in plain])
    params = {n.replace(".mlp.router", ".mlp.router.weight").replace(".mlp.w_", ".mlp.experts.w_"): p.detach().clone()
              for n, p in model.named_parameters()}
    return {"losses": losses, "biases": biases[-1], "params": params, "flips": sum(p.flips for p in plain)}


def train_bias(runs: list[tuple[list[str], str]]) -> list[dict]:
    """On every rank: train each run; losses, local parameters, placements and every block's bias by its
    global name (the router weight's, from its placement)."""
    from threefold.models.moe import moe_modules
    from threefold.train.trainer import Trainer

    out = []
    for overrides, path in runs:
        trainer = Trainer(make_config(overrides, path))
        records = trainer.run()
        module, places = trainer.parallel.module, trainer.parallel.placements
        biases = {places[f"{name}.router.weight"].name.removesuffix(".router.weight"): moe.expert_bias.clone()
                  for name, moe in moe_modules(module)}
        out.append({"losses": [r["loss"] for r in records], "extras": [r.get("mtp_loss") for r in records],
                    "biases": biases, "placements": dict(places),
                    "params": {n: p.detach().float().clone() for n, p in module.named_parameters()}})
    return out


def assert_biases_match(name: str, results: list[dict], want: list[torch.Tensor]) -> None:
    """Every rank's copy of every block's bias (`train_bias`) is exactly the reference's block by block."""
    held = {}
    for r in results:
        for block, bias in r["biases"].items():
            held.setdefault(block, []).append(bias)
    assert sorted(held) == [f"blocks.{i}.mlp" for i in range(len(want))], f"{name}: blocks {sorted(held)}"
    for i, bias_want in enumerate(want):
        for bias in held[f"blocks.{i}.mlp"]:
            assert bias.dtype == torch.float32 and torch.equal(bias, bias_want), f"{name} block {i}: {bias} != {bias_want}"


def test_bias_balancing_matches_a_plain_reference(worlds, tmp_path, capsys):
    ref = reference_run(BASE)
    assert ref["flips"] > 0, "the bias never changed a choice: the case would not test it"
    runs = {"(1,1,1)": [r[0] for r in worlds(1).run(train_bias, [(BASE, str(tmp_path / "one"))])]}
    two = {n: o for n, (w, o) in LAYOUTS.items() if w == 2}
    four = {n: o for n, (w, o) in LAYOUTS.items() if w == 4}
    for world, chosen in ((2, two), (4, four)):
        per_rank = worlds(world).run(train_bias, [(BASE + o, str(tmp_path / f"r{i}")) for i, o in enumerate(chosen.values())])
        runs.update({name: [r[i] for r in per_rank] for i, name in enumerate(chosen)})
    lines = []
    for name, results in runs.items():
        loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
        got = assemble([r["params"] for r in results], [r["placements"] for r in results])
        assert got.keys() == ref["params"].keys()
        param, worst = max((rel_err(got[k], v), k) for k, v in ref["params"].items())
        lines.append(f"{name}: loss {loss:.1e} params {param:.1e} ({worst})")
        assert loss <= TOL and param <= TOL, lines[-1]
        assert_biases_match(name, results, ref["biases"])
    with capsys.disabled():
        print(f"\nbias balancing against the plain reference, {STEPS} steps:\n  " + "\n  ".join(lines))


@pytest.mark.parametrize("overrides, key", [
    (["model.preset=tiny", "model.router_balance=bias"], "model.router_balance"),
    (["model.preset=tiny-moe", "model.router_bias_rate=0.01"], "model.router_bias_rate"),
    (["model.preset=tiny-moe", "model.router_seq_aux_weight=0.01"], "model.router_seq_aux_weight"),
    (["model.preset=tiny-moe", "model.router_balance=bias", "model.router_aux_weight=0.1"], "model.router_aux_weight"),
    (["model.preset=tiny-moe", "model.router_balance=bias", "model.router_bias_rate=-1"], "model.router_bias_rate"),
])
def test_balance_keys_that_would_do_nothing_are_refused(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides).validate(1)
    assert key in str(err.value)
