"""Multi-token prediction on a mixture of experts with bias balancing, against a plain PyTorch reference written here.

The model is `tiny-moe` (every block a mixture of experts) with `model.mtp_depth=2` (the depths are dense
blocks, as models/mtp.py states), `model.router_balance=bias` and the sequence-wise balance loss. The
reference shares only the initial weights (by name) and the token batches with threefold: a functional
Llama decoder whose blocks route with softmax scores, the top k of scores + bias, the gates from the
unbiased scores renormalised over the k and every expert computed densely; DeepSeek-V3's MTP depths on
the last block's output (depth k on the row cut to its s - k positions, the shared embedding and head);
momentum-free SGD; after each step b_e += rate x sign(mean load - load_e) over the whole global batch.

threefold under (1,1,1) and, in one world of 4 ranks, ep2 (dp4: ep2 x edp2), dp2 ep2 ZeRO-1, tp2 ep2 and
pp2 ep2 (the depths on the last stage, the MoE blocks one per stage) matches it within 1e-5 per tensor:
the loss of every step, the logged `mtp_loss` of every step and every parameter after the last; every
rank's copy of every block's expert bias equals the reference's exactly. (cp is refused with MTP:
config/mtp_checks.py.) ep2 runs at dp4, ep2 x edp2, so that one world serves every layout: it is dp2 ep2
without ZeRO. One torch thread per process (`run.threads=1`, and the reference's): on a busy two-core
machine a second thread spent seconds spin-waiting on these tiny operations.
"""

import torch
import torch.nn.functional as F

from tests.distributed.test_moe_bias import assert_biases_match, train_bias
from tests.helpers import make_config, rel_err
from tests.unit.test_mtp import attention, rms
from tests.zero_tasks import assemble
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model

STEPS, TOL = 4, 1e-5
BASE = ["model.preset=tiny-moe", "model.mtp_depth=2", "model.mtp_weight=0.5", "train.global_batch=8",
        "train.seq_len=16", f"train.steps={STEPS}", "train.optimizer=sgd", "train.lr=0.5", "train.momentum=0",
        "train.weight_decay=0", "train.grad_clip=0", "train.min_lr_ratio=1.0", "train.warmup_steps=0",
        "train.eval_every=0", "model.router_z_weight=0", "model.router_balance=bias",
        "model.router_bias_rate=0.01", "model.router_seq_aux_weight=0.01", "run.threads=1"]
FOUR = {"ep2 (dp4)": ["parallel.dp=4", "parallel.ep=2"],
        "dp2 ep2 zero1": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"],
        "tp2 ep2": ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"],
        "pp2 ep2": ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "train.microbatches=2"]}


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(p: dict, pre: str, x: torch.Tensor, bias: torch.Tensor, m,
        load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, summed per-sequence balance loss) of a bias-routed mixture of experts on x (b, s, h); adds its
    assignments per expert to `load`."""
    e, k = m.experts, m.experts_top_k
    probs = (x @ p[pre + "router.weight"].T).softmax(-1)  # (b, s, e)
    idx = (probs + bias).topk(k, -1).indices
    gate = probs.gather(-1, idx)
    gate = gate / gate.sum(-1, keepdim=True)
    w = [p[pre + f"experts.w_{n}"] for n in ("gate", "up", "down")]
    every = torch.stack([swiglu(x, w[0][j], w[1][j], w[2][j]) for j in range(e)], 2)  # (b, s, e, h): every token
    picked = every.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))
    chosen = F.one_hot(idx, e).sum(2).float()  # (b, s, e)
    load += chosen.sum((0, 1))
    balance = e * ((chosen.mean(1) / k) * probs.mean(1)).sum(-1)  # (b,)
    return (gate.unsqueeze(-1) * picked).sum(2), balance.sum()


def plain_loss(p: dict, rows: torch.Tensor, biases: list, loads: list, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(main summed cross-entropy + weighted balance losses, mtp_weight / D x the depths' summed cross-entropies)
    of token rows (b, s + 1)."""
    s = rows.shape[1] - 1
    x = p["embed.tok.weight"][rows[:, :s]]
    main = 0.0
    for i in range(m.layers):
        pre = f"blocks.{i}."
        x = attention(p, pre, x, m)
        y, balance = moe(p, pre + "mlp.", rms(x, p[pre + "mlp_norm.weight"], m.norm_eps), biases[i], m, loads[i])
        x = x + y
        main = main + m.router_seq_aux_weight * s * balance  # a per-sequence mean, as a sum of s token losses
    logits = rms(x, p["norm.weight"], m.norm_eps) @ p["head.weight"].T
    main = main + F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    extra, h = 0.0, x
    for k in range(1, m.mtp_depth + 1):
        n, pre = s - k, f"mtp.{k - 1}."
        e = p["embed.tok.weight"][rows[:, k:k + n]]  # t_{i+k}
        joined = torch.cat([rms(h[:, :n], p[pre + "hidden_norm.weight"], m.norm_eps),
                            rms(e, p[pre + "embed_norm.weight"], m.norm_eps)], -1)
        h = attention(p, pre + "block.", joined @ p[pre + "proj.weight"].T, m)
        b = pre + "block.mlp."
        h = h + swiglu(rms(h, p[pre + "block.mlp_norm.weight"], m.norm_eps), p[b + "gate.weight"], p[b + "up.weight"],
                       p[b + "down.weight"])
        logits = rms(h, p[pre + "norm.weight"], m.norm_eps) @ p["head.weight"].T
        extra = extra + F.cross_entropy(logits.flatten(0, 1), rows[:, k + 1:k + 1 + n].flatten(), reduction="sum")
    return main, m.mtp_weight / m.mtp_depth * extra


def reference_run(overrides: list[str]) -> dict:
    """On one thread: tiny matmuls on a shared machine's two would spend seconds in the threads' spin-waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(overrides)
    finally:
        torch.set_num_threads(threads)


def _reference_run(overrides: list[str]) -> dict:
    cfg = make_config(overrides, "unused")
    t, m = cfg.train, cfg.model
    p = {n: q.detach().clone().requires_grad_() for n, q in build_model(m, t.seed).named_parameters()}
    optimizer = torch.optim.SGD(list(p.values()), lr=t.lr)
    sampler = Sampler(load_tokens(cfg.data.source, m.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    biases = [torch.zeros(m.experts) for _ in range(m.layers)]
    losses, extras, flips = [], [], 0
    for step in range(STEPS):
        batch = sampler.step_batch(step)
        rows = torch.cat([batch.inputs, batch.targets[:, -1:]], 1)
        loads = [torch.zeros(m.experts) for _ in range(m.layers)]
        main, extra = plain_loss(p, rows, biases, loads, m)
        with torch.no_grad():  # the experts whose load the bias changed (the same rows routed without it)
            unbiased = [torch.zeros(m.experts) for _ in range(m.layers)]
            plain_loss(p, rows, [torch.zeros(m.experts)] * m.layers, unbiased, m)
            flips += sum(int((a != b).sum()) for a, b in zip(loads, unbiased))
        loss = (main + extra) / batch.targets.numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for bias, load in zip(biases, loads):  # after the update
            bias += m.router_bias_rate * (load.mean() - load).sign()
        losses.append(float(loss.detach()))
        extras.append(float(extra.detach()) / batch.targets.numel())
    return {"losses": losses, "extras": extras, "biases": biases, "flips": flips,
            "params": {n: q.detach() for n, q in p.items()}}


def test_mtp_on_bias_balanced_experts_matches_a_plain_reference(worlds, tmp_path, capsys):
    ref = reference_run(BASE)
    assert ref["flips"] > 0, "the bias never changed a choice: the case would not test it"
    assert ref["extras"][0] > 0.3 * ref["losses"][0]  # the depths weigh in the loss
    runs = {"(1,1,1)": [r[0] for r in worlds(1).run(train_bias, [(BASE, str(tmp_path / "one"))])]}
    per_rank = worlds(4).run(train_bias, [(BASE + o, str(tmp_path / f"r{i}")) for i, o in enumerate(FOUR.values())])
    runs.update({name: [r[i] for r in per_rank] for i, name in enumerate(FOUR)})
    lines = []
    for name, results in runs.items():
        loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
        extra = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["extras"], ref["extras"], strict=True))
        got = assemble([r["params"] for r in results], [r["placements"] for r in results])
        assert got.keys() == ref["params"].keys(), name
        param, worst = max((rel_err(got[k], v), k) for k, v in ref["params"].items())
        lines.append(f"{name}: loss {loss:.1e} mtp_loss {extra:.1e} params {param:.1e} ({worst})")
        assert loss <= TOL and extra <= TOL and param <= TOL, lines[-1]
        assert_biases_match(name, results, ref["biases"])
    with capsys.disabled():
        print(f"\nMTP on bias-balanced experts against the plain reference, {STEPS} steps:\n  " + "\n  ".join(lines))
