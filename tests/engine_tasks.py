"""What each rank runs for tests/distributed/test_engine.py (importable by the spawned ranks), and the
single-process reference: the user's plain PyTorch loop with torch.optim.AdamW."""

import torch
from torch import nn

from tests import engine_models

STEPS, SAVED, BATCH = 6, 3, 8  # a resume loads the step-SAVED checkpoint
CONFIG = [f"train.steps={STEPS}", "train.lr=3e-3", "train.eps=1e-6", "train.grad_clip=0.5", "train.weight_decay=0.1",
          "train.beta2=0.95", "parallel.bucket_mb=0.001"]  # small buckets: several per model
UNITS = {"ConvBN": None, "ViT": [nn.TransformerEncoderLayer], "FrozenShared": ["a", "b", "head", "unused"]}
# tensor parallelism of the ViT's MLPs, as torch's parallelize_module plans name it
PLANS = {"ViT": {"encoder.layers.*.linear1": "colwise", "encoder.layers.*.linear2": "rowwise"}}


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


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["linear1", "linear2"]}  # peft LoraConfig of the ViT's MLPs


def lora_config():
    from peft import LoraConfig

    return LoraConfig(**LORA)


def _engine(name: str, overrides: list[str], seed: int, lora: bool = False):
    import threefold

    planned = any(o.startswith("parallel.tp=") and o != "parallel.tp=1" for o in overrides)
    return threefold.prepare(build(name, seed), nn.CrossEntropyLoss(), CONFIG + overrides, units=UNITS[name],
                             plan=PLANS[name] if planned else None, lora=lora_config() if lora else None)


def run_lora(name: str, overrides: list[str]) -> dict:
    """STEPS steps of a peft LoRA model through `threefold.prepare(..., lora=LoraConfig)`."""
    e = _engine(name, overrides, 0, lora=True)
    records = _steps(e, 1, STEPS)
    return {"losses": [r["loss"] for r in records], **_state(e), "trainable": sum(p.numel() for p in e.module.parameters() if p.requires_grad),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in e.optimizer.state_tensors()),
            "updated": sorted({piece.name for piece in e.optimizer.pieces})}


def _state(e) -> dict:
    """This rank's checkpoint tensors (its pieces, cloned) and their placements."""
    e.parallel.settle()
    named, places = e.parallel.checkpoint_tensors()
    return {"tensors": {k: v.detach().clone() for k, v in named}, "placements": places}


def _steps(e, first: int, last: int) -> list[dict]:
    rank, n = e.batch_shard
    out = []
    for step in range(first, last + 1):
        x, y = batch(step)
        out.append(e.train_step((local(x, rank, n), local(y, rank, n))))
    return out


def resume(name: str, overrides: list[str], ckpt: str) -> dict:
    """An engine of another init (and perhaps another layout) loads `ckpt` (step SAVED) and runs the rest."""
    e = _engine(name, overrides, 7)
    assert e.load(ckpt) == SAVED
    records = _steps(e, SAVED + 1, STEPS)
    x, y = batch(1)
    return {"losses": [r["loss"] for r in records], **_state(e), "eval": e.eval_step((x[:4], y[:4]))}


def run(name: str, overrides: list[str], ckpt: str | None = None) -> dict:
    """STEPS steps of `threefold.prepare`; with `ckpt`, also SAVED steps, save, a fresh engine from another
    init loads it, the rest: both runs' final tensors (this rank's pieces) and placements."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    e = _engine(name, overrides, 0)
    records = _steps(e, 1, STEPS)
    report = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
              "comm": [r["comm"] for r in records], "graphs": counters["stats"]["unique_graphs"] - graphs,
              **_state(e)}
    if ckpt is not None:
        e = _engine(name, overrides, 0)
        _steps(e, 1, SAVED)
        e.save(ckpt)
        e = _engine(name, overrides, 7)  # other initial values: everything must come from the checkpoint
        assert e.load(ckpt) == SAVED
        report["resumed"] = [r["loss"] for r in _steps(e, SAVED + 1, STEPS)]
        report["resumed_state"] = _state(e)["tensors"]
    return report


def reference(name: str, chunks: int, lora: bool = False) -> dict:
    """The user's loop: AdamW (matrices decayed), clipping, the cosine schedule. With `chunks` > 1 each
    step's batch runs as that many forwards (as dp ranks would), batch-norm statistics averaged."""
    from threefold.train.optim import lr_at
    from threefold.config import load_config

    train = load_config(None, CONFIG).train
    model = build(name)
    if lora:  # peft's own LoRA model, trained by the plain loop
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
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
