"""PipeDream-2BW (pipeline/two_bw.py) against a plain single-process PyTorch reference (gloo, CPU).

The reference is written out here with torch alone: the same initial weights and batches (read
from a one-process threefold run that trains nothing), and the delayed update by hand,

    W(s) = W(s - 1) - lr(s) * grad f_s(W(max(s - 2, 0)))      (step s, 1-based; plain SGD)

whose loss at step s is batch s's at that same W(max(s - 2, 0)). The 2BW run must match it in
every step's loss and gradient norm and in every final parameter (relative 1e-5), and its record
of weight versions must show each backward reading the version its forward read: version
max(b - 1, 0) for batch b (0-based), on every stage, for every micro-batch.
"""

import torch

from tests.helpers import make_config, rel_err

TOL = 1e-5
STEPS = 6
BASE = ["model.preset=tiny", "model.layers=4", "model.tie_embeddings=false", "train.global_batch=8",
        "train.seq_len=16", "train.optimizer=sgd", "train.momentum=0", "train.weight_decay=0", "train.grad_clip=0",
        "train.lr=0.5", "train.warmup_steps=2", "train.min_lr_ratio=0.2", f"train.steps={STEPS}"]


def two_bw_run(overrides: list[str], out: str) -> dict:
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    runtime = trainer.parallel.pipeline
    runtime.log = []
    records = trainer.run()
    params = {trainer.parallel.placements[n].name: q.detach().clone()
              for n, q in trainer.parallel.module.named_parameters()}
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "lrs": [r["lr"] for r in records], "params": params, "log": runtime.log, "pp": trainer.mesh.rank("pp")}


def reference_run(overrides: list[str], out: str) -> dict:
    """Initial weights and batches from threefold (one process, nothing trained), the update by hand."""
    from threefold.data.loader import bound_ids
    from threefold.train.optim import lr_at
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    cfg, model = trainer.cfg, trainer.parallel.module
    tokens = cfg.train.global_batch * cfg.train.seq_len
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    versions = [{n: q.detach().clone() for n, q in named}]  # W(0), W(1), ...
    losses, norms = [], []
    for s in range(1, STEPS + 1):
        micro_batches, _ = trainer.loader.get(s - 1)
        micro_batches, _ = bound_ids(micro_batches, cfg.model.vocab)
        used = versions[max(s - 2, 0)]
        with torch.no_grad():
            for n, q in named:
                q.copy_(used[n])
        for _, q in named:
            q.grad = None
        total = 0.0
        for mb in micro_batches:
            loss_sum = model(mb.inputs, mb.targets)
            (loss_sum / tokens).backward()
            total += loss_sum.item()
        grads = {n: q.grad.detach().clone() for n, q in named}
        losses.append(total / tokens)
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item())
        lr = lr_at(s, cfg.train)
        versions.append({n: versions[-1][n] - lr * grads[n] for n, _ in named})
    trainer.loader.close()
    names = trainer.parallel.placements
    final = {n: versions[-1].get(n, q.detach()) for n, q in model.named_parameters()}  # frozen ones as they were
    return {"losses": losses, "norms": norms, "params": {names[n].name: v for n, v in final.items()}}


def test_two_bw_matches_the_delayed_update_and_keeps_versions(worlds, tmp_path):
    m = 4
    ref = worlds(1).run(reference_run, BASE + [f"train.microbatches={m}"], str(tmp_path / "ref"))[0]
    results = worlds(2).run(two_bw_run, BASE + ["parallel.pp=2", "pipeline.schedule=pipedream-2bw",
                                                f"train.microbatches={m}"], str(tmp_path / "2bw"))
    last = next(r for r in results if r["pp"] == 1)
    for s, (a, b) in enumerate(zip(last["losses"], ref["losses"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {s}: loss {a} vs reference {b}"
    # step s reports the norm of the gradient it applied: batch s - 1's (none at step 1)
    assert last["norms"][0] == 0.0
    for s in range(2, STEPS + 1):
        a, b = last["norms"][s - 1], ref["norms"][s - 2]
        assert abs(a - b) <= TOL * b, f"step {s}: grad norm {a} vs reference {b}"
    held = {}
    for r in results:
        held.update(r["params"])
        for name, value in r["params"].items():
            assert rel_err(value, ref["params"][name]) <= TOL, f"pp={r['pp']}: parameter {name}"
    assert set(held) == set(ref["params"])
    # the weight versions: every forward and backward of batch b read version max(b - 1, 0)
    for r in results:
        seen = {}
        for kind, stage, mb, version in r["log"]:
            batch = mb // m
            assert version == max(batch - 1, 0), f"{kind}{mb}@s{stage} read version {version}"
            seen.setdefault((stage, mb), []).append((kind, version))
        assert len(seen) == STEPS * m
        assert all([k for k, _ in v] == ["F", "B"] and v[0][1] == v[1][1] for v in seen.values())
    # no flush in the runtime's timeline: on rank 0, each batch's first forwards run before the
    # previous batch's last backward (they are in one step's segment)
    order = [(kind, mb) for kind, _, mb, _ in next(r for r in results if r["pp"] == 0)["log"]]
    for b in range(1, STEPS):
        assert order.index(("F", b * m)) < order.index(("B", b * m - 1)), f"batch {b} waited for a flush"
