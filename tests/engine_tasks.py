"""What each rank runs for tests/distributed/test_engine.py (importable by the spawned ranks), and the
single-process reference: the user's plain PyTorch loop with torch.optim.AdamW."""

import torch
from torch import nn

from tests import engine_models

STEPS, BATCH = 10, 8
CONFIG = ["train.steps=10", "train.lr=3e-3", "train.eps=1e-6", "train.grad_clip=0.5", "train.weight_decay=0.1",
          "train.beta2=0.95", "parallel.bucket_mb=0.001"]  # small buckets: several per model
UNITS = {"ConvBN": None, "ViT": [nn.TransformerEncoderLayer], "FrozenShared": ["a", "b", "head", "unused"]}


def batch(step: int):
    """The global batch of 1-based `step`: images and labels, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return getattr(engine_models, name)()


def local(x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    per = x.shape[0] // n
    return x[rank * per: (rank + 1) * per]


def run(name: str, overrides: list[str], ckpt: str | None = None) -> dict:
    """10 steps of `threefold.prepare`; with `ckpt`, also 5 steps, save, a fresh engine from another
    init loads it, 5 more: both runs' final tensors (this rank's pieces) and placements."""
    import threefold

    def engine(seed: int):
        return threefold.prepare(build(name, seed), nn.CrossEntropyLoss(), CONFIG + overrides, units=UNITS[name])

    def steps(e, first: int, last: int) -> list[dict]:
        rank, n = e.mesh.rank("dp"), e.mesh.size("dp")
        out = []
        for step in range(first, last + 1):
            x, y = batch(step)
            out.append(e.train_step((local(x, rank, n), local(y, rank, n))))
        return out

    def state(e) -> dict:
        e.parallel.settle()
        named, places = e.parallel.checkpoint_tensors()
        return {"tensors": {k: v.detach().clone() for k, v in named}, "placements": places}

    e = engine(0)
    records = steps(e, 1, STEPS)
    report = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
              "comm": [r["comm"] for r in records], **state(e)}
    if ckpt is not None:
        e = engine(0)
        steps(e, 1, 5)
        e.save(ckpt)
        e = engine(7)  # other initial values: everything must come from the checkpoint
        assert e.load(ckpt) == 5
        report["resumed"] = [r["loss"] for r in steps(e, 6, STEPS)]
        report["resumed_state"] = state(e)["tensors"]
    return report


def reference(name: str, chunks: int) -> dict:
    """The user's loop: AdamW (matrices decayed), clipping, the cosine schedule. With `chunks` > 1 each
    step's batch runs as that many forwards (as dp ranks would), batch-norm statistics averaged."""
    from threefold.train.optim import lr_at
    from threefold.config import load_config

    train = load_config(None, CONFIG).train
    model = build(name)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    loss_fn = nn.CrossEntropyLoss()
    for p in params:  # a parameter no step uses has a zero gradient (decayed, moments updated), never None
        p.grad = torch.zeros_like(p)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        opt.zero_grad(set_to_none=False)
        start = {k: b.clone() for k, b in model.named_buffers()}
        seen, total = [], 0.0
        for c in range(chunks):
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(start[k])
            loss = loss_fn(model(local(x, c, chunks)), local(y, c, chunks)) / chunks
            loss.backward()
            total += loss.item()
            seen.append({k: b.clone() for k, b in model.named_buffers()})
        with torch.no_grad():
            for k, b in model.named_buffers():
                if b.is_floating_point():
                    b.copy_(torch.stack([s[k] for s in seen]).mean(0))
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, train)
        opt.step()
        losses.append(total)
    return {"losses": losses, "tensors": {**dict(model.named_parameters()), **dict(model.named_buffers())}}
