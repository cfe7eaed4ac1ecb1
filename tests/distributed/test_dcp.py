"""torch.distributed.checkpoint in and out, against plain PyTorch written out here.

(a) A plain loop - the model as an nn.Module, `torch.optim.AdamW`, `F.cross_entropy` - trains K
steps and saves with torch's own `get_state_dict` (flattened optimizer state, torchtitan's form)
and `dcp.save`; threefold loads that directory under (1,1,1) and (2,2,2) ZeRO-1 and continues to
N steps within 1e-5 of the plain loop continuing itself; `init_from` takes its weights bitwise.
(b) The (2,2,2) run's own checkpoint, exported with `threefold ckpt export --dcp`, loads in plain
torch (`dcp.load` of a plain model's and AdamW's state dict, then `set_state_dict`) bitwise equal,
weights and moments, to the checkpoint's global tensors.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tests.helpers import make_config, rel_err
from tests.zero_tasks import assemble
from threefold.checkpoint.format import DTYPES, read_manifest, step_dir_name
from threefold.checkpoint.reader import load_entries
from threefold.checkpoint.state import Entry
from threefold.cli import main
from threefold.data import Sampler, load_tokens
from threefold.models.decoder import build_model
from threefold.sharding import Placement

K, N = 3, 6
BASE = ["model.preset=tiny", "model.layers=2", "train.global_batch=8", "train.seq_len=16", f"train.steps={N}",
        "train.lr=2e-3", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "train.weight_decay=0.1",
        "train.eps=1e-6", "train.grad_clip=0", "train.microbatches=2"]
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1", "pipeline.schedule=1f1b"]
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's optimizer state dict
TOL = 1e-5


def plain_model_and_optimizer(cfg):
    model = build_model(cfg.model, cfg.train.seed)
    t = cfg.train
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def plain_run(dcp_dir: Path) -> dict:
    """K steps, dcp.save of get_state_dict, then on to N steps (constant lr, no clipping)."""
    cfg = make_config(BASE, "unused")
    t = cfg.train
    torch.manual_seed(0)
    model, optimizer = plain_model_and_optimizer(cfg)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    saved = {}
    for step in range(1, N + 1):
        batch = sampler.step_batch(step - 1)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == K:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(dcp_dir), no_dist=True)
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"saved": saved, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def continue_from_dcp(overrides: list[str], out: str, dcp_dir: str) -> dict:
    """On every rank, through the config keys a user sets: the weights by checkpoint.init_from (read before
    any step), then a run resumed from the same directory (checkpoint.resume) continued to N steps."""
    from threefold.train.trainer import Trainer

    started = Trainer(make_config(overrides + [f"checkpoint.init_from={dcp_dir}"], f"{out}-init"))
    initial = {n: p.detach().clone() for n, p in started.parallel.module.named_parameters()}
    del started
    trainer = Trainer(make_config(overrides + [f"checkpoint.resume={dcp_dir}"], out))
    assert trainer.step == K, f"resumed at step {trainer.step}, not {K}"
    records = trainer.run()
    return {"initial": initial, "steps": [r["step"] for r in records], "placements": trainer.parallel.placements,
            "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}}


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    plain = plain_run(root / "plain-dcp")
    one = worlds(1).run(continue_from_dcp, BASE, str(root / "one"), str(root / "plain-dcp"))
    saving = BASE + LAYOUT + [f"checkpoint.save_every={N}"]
    eight = worlds(8).run(continue_from_dcp, saving, str(root / "eight"), str(root / "plain-dcp"))
    return root, plain, {"(1,1,1)": one, "(2,2,2) ZeRO-1": eight}


def test_a_plain_dcp_checkpoint_loads_under_any_layout_and_continues(runs, capsys):
    _, plain, results = runs
    lines = []
    for name, ranks in results.items():
        assert all(r["steps"] == list(range(K + 1, N + 1)) for r in ranks), f"{name}: did not resume at step {K + 1}"
        initial = assemble([r["initial"] for r in ranks], [r["placements"] for r in ranks])
        assert initial.keys() == plain["saved"].keys()
        for key, value in plain["saved"].items():
            assert torch.equal(initial[key], value), f"{name}: init_from {key} is not the saved weight"
        final = assemble([r["params"] for r in ranks], [r["placements"] for r in ranks])
        err, worst = max((rel_err(final[k], v), k) for k, v in plain["params"].items())
        lines.append(f"{name}: steps {K + 1}-{N} params {err:.1e} ({worst})")
        assert err <= TOL, lines[-1]
        # not a no-op: the moments matter (a restart from the weights alone lands elsewhere)
        assert max(rel_err(final[k], plain["saved"][k]) for k in final) > 1e-3
    with capsys.disabled():
        print("\nresumed from plain torch's DCP checkpoint, against the plain loop:\n  " + "\n  ".join(lines))


def global_tensor(ckpt: Path, manifest, name: str) -> torch.Tensor:
    info = manifest.tensors[name]
    full = torch.zeros(info.shape, dtype=DTYPES[info.dtype])
    load_entries(ckpt, {name: info}, [Entry(name, full, Placement.whole(name, info.shape))])
    return full


def test_b_an_exported_checkpoint_loads_in_plain_torch_bitwise(runs, tmp_path, capsys):
    root = runs[0]
    ckpt = root / "eight" / "checkpoints" / step_dir_name(N)
    out = tmp_path / "exported"
    assert main(["ckpt", "export", str(ckpt), "--dcp", str(out)]) == 0
    assert "optimizer state tensors" in capsys.readouterr().out
    cfg = make_config(BASE, "unused")
    model, optimizer = plain_model_and_optimizer(cfg)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)  # plain torch's own keys
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=FLAT)
    manifest = read_manifest(ckpt)
    moments = 0
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), global_tensor(ckpt, manifest, f"model/{name}")), name
        held = optimizer.state[param]
        if not param.requires_grad:  # the attention's key bias (softmax ignores it): no moments
            assert not held, name
            continue
        assert float(held["step"]) == N, f"{name}: step {held['step']}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(held[key], global_tensor(ckpt, manifest, f"optim/{name}/{key}")), f"{name} {key}"
            moments += 1
    assert moments == 2 * sum(p.requires_grad for p in model.parameters()) > 0
