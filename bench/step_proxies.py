"""CPU proxies of a GPU step: aten operations, bytes moved and host-device syncs per training step, threefold
against the plain loop a GPU user would write (bench/plain_loop.py), on the same model and batch.

    python bench/step_proxies.py [--models gpt2-124m,llama-1b] [--layers 2] [--seq 128] [--batch 2]
                                 [--modes eager,compiled] [--json PATH] [--top 12]

* **threefold** - one process, its real step as `threefold train --nproc 1` runs it: `Trainer` (fp32 on CPU,
  the CUDA path's fused AdamW switched on, `master.fused_on`), counted over `TrainStep` (forward_backward,
  gradient norm, clipping, update) for the operations and bytes, and over the whole step path
  (`launch_step` + `finish_step`: loader, id bound, metrics all-reduce, figures read, memory) for syncs;
* **plain** - `make_plain(...).step` with the same weights' shape and the same micro-batch, with fused
  AdamW (the CUDA path's; its CPU kernel), counted over its step.

Modes: eager, and compiled with the `aot_eager` backend (threefold: `train.compile=true`, per block; plain:
the whole model): the operations counted are those of the compiled graphs as AOT autograd hands them to a
backend (functionalised aten, before inductor's fusion) plus what runs eagerly around them. They are not
inductor's kernel count.

Counts (`Counted`, a TorchDispatchMode): an operation is every aten call that is not a view (views launch
nothing; nor do the profiler's record_function marks); its bytes are the bytes of its tensor arguments
(read) and of its outputs and mutated arguments (written), where an argument an operation only overwrites
(copy_, fill_, zero_, out=) is not read;
`empty` writes nothing; an indexed operation (gather, embedding, index_select, scatter, nll_loss_forward)
moves its indices and the elements it touches, nll_loss_backward and embedding_dense_backward write
their whole (zeroed) gradient. A sync is a read of a tensor's value by the host: `_local_scalar_dense` (.item(),
float(), bool(), `if t:`), equal, is_nonzero, nonzero, masked_select, unique; `.tolist()`, `.numpy()` of a
tensor that is not a host buffer; and a wait for the device (torch.cuda.synchronize, an event's
synchronize: threefold's one read of the step's figures). Each op is filed under its source: in backward
the autograd node that issued it, in forward the innermost threefold / plain_loop / torch.optim function.

Loss bytes per logit: threefold's summed cross-entropy against `F.cross_entropy` (over fp32 logits, as
autocast hands them to it on CUDA; bf16 logits are cast first), forward and backward of 64 x 8192 logits.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plain_loop import BETAS, LR, WEIGHT_DECAY, make_plain, shape_of  # noqa: E402

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default, aten.nonzero.default,
         aten.masked_select.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
OVERWRITE = {"copy_", "fill_", "zero_", "_foreach_zero_", "_foreach_copy_", "normal_", "uniform_"}
GATHERS = {"gather", "embedding", "index_select"}
SCATTERS = {"scatter_add_", "scatter_add", "scatter_", "scatter"}
NOTHING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
LLAMA_1B = ["model.preset=llama-7b", "model.layers=16", "model.hidden=2048", "model.heads=32", "model.kv_heads=8",
            "model.ffn_hidden=8192", "model.vocab=128256", "model.rope_theta=500000.0", "model.tie_embeddings=true"]
# name -> (the plain loop's shape, threefold's overrides)
MODELS = {"gpt2-124m": ("gpt2-124m", ["model.preset=gpt2-124m"]), "llama-1b": ("llama-1b", LLAMA_1B),
          "tiny": ("tiny", ["model.preset=tiny"]), "tiny-llama": ("tiny-llama", ["model.preset=tiny-llama"])}
HERE = ("/threefold/", "plain_loop.py", "/torch/optim/", "/torch/nn/utils/")


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _indexed_bytes(name: str, args, out) -> int | None:
    """Operations that touch one element per index, not their whole operand (a gather kernel reads what it
    gathers): the indices, the elements read and the elements written; None for every other operation."""
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if name in GATHERS:  # (table, ..., index): reads the indices and as many elements as it writes
        index = next(t for t in args[1:] if isinstance(t, torch.Tensor))
        return _nbytes([index]) + 2 * _nbytes(outs)
    if name in SCATTERS:  # (self, dim, index, src): reads index and src, reads and writes src's count of self
        index, src = args[2], args[3]
        return _nbytes([index]) + 3 * (src.numel() * args[0].element_size() if isinstance(src, torch.Tensor) else 0)
    if name == "nll_loss_forward":  # (logits, target, ...): one logit per target
        return _nbytes([args[1]]) + args[1].numel() * args[0].element_size() + _nbytes(outs)
    if name in ("nll_loss_backward", "embedding_dense_backward"):  # the whole gradient written (zeroed), the
        grad_out = args[0]  # incoming gradient and the indices read
        return _nbytes([grad_out, args[2] if name == "nll_loss_backward" else args[1]]) + _nbytes(outs)
    return None


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes an operation reads and writes (the module docstring's rule)."""
    name = func.__name__.split(".")[0]
    if name in NOTHING:
        return 0
    indexed = _indexed_bytes(name, args, out)
    if indexed is not None:
        return indexed
    written, read = [], []
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        mutated = a.alias_info is not None and a.alias_info.is_write
        if mutated:
            written += tensors
        if not (mutated and (name in OVERWRITE or a.name == "out")):
            read += tensors
    seen = {id(t) for t in written}
    written += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and id(t) not in seen]
    return _nbytes(read) + _nbytes(written)


def source_of() -> str:
    """Who issued the current operation: its autograd node in backward, else the innermost function of
    threefold, the plain loop or torch's optimizer / clipping; `compiled graph` inside one."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward {node.name()}"
    frame = sys._getframe(2)
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith("<eval_with_key"):
            return "compiled graph"
        if any(h in f for h in HERE) and "step_proxies" not in f:
            short = f.split("/threefold/")[-1] if "/threefold/" in f else f.rsplit("/", 1)[-1]
            return f"{short}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


class Counted(TorchDispatchMode):
    """Operations (by name and by source), bytes (by name) and host reads under `with Counted() as c:`."""

    def __init__(self, sources: bool = True):
        super().__init__()
        self.ops, self.bytes = collections.Counter(), collections.Counter()
        self.by_source: collections.Counter = collections.Counter()
        self.syncs: list[str] = []
        self.sources = sources

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled while counted (not eagerly): its graphs' operations are what is seen."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in READS:
            self.syncs.append(f"{func.__name__} at {source_of()}")
        if not func.is_view and func.namespace != "profiler":  # record_function marks launch nothing
            name = func.__name__
            self.ops[name] += 1
            self.bytes[name] += op_bytes(func, args, kwargs, out)
            if self.sources:
                self.by_source[(source_of(), name)] += 1
        return out

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


class HostReads:
    """`.tolist()` / `.numpy()` of tensors that are not host buffers, and device waits, while entered."""

    def __init__(self, counted: Counted, host_buffers: set[int]):
        self.counted, self.host_buffers, self.saved = counted, host_buffers, []

    def _wrap(self, owner, name: str, label: str, check=None):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if check is None or check(*args):
                self.counted.syncs.append(f"{label} at {source_of()}")
            return inner(*args, **kwargs)
        self.saved.append((owner, name, inner))
        setattr(owner, name, wrapped)

    def __enter__(self):
        device_tensor = lambda t, *a: t.untyped_storage().data_ptr() not in self.host_buffers  # noqa: E731
        self._wrap(torch.Tensor, "tolist", "tolist", device_tensor)
        self._wrap(torch.Tensor, "numpy", "numpy", device_tensor)
        self._wrap(torch.cuda, "synchronize", "cuda.synchronize")
        return self

    def __exit__(self, *exc):
        for owner, name, inner in reversed(self.saved):
            setattr(owner, name, inner)


def _threefold_config(model: str, layers: int, seq: int, batch: int, compiled: bool, out: str):
    from threefold.config import load_config

    return load_config(None, [*MODELS[model][1], f"model.layers={layers}", f"train.seq_len={seq}",
                              f"train.global_batch={batch}", "train.microbatches=1", "train.steps=100",
                              "data.prefetch=0", f"run.out={out}", "run.progress=false", "run.plot=false",
                              "checkpoint.save_every=0",
                              *(["train.compile=true", "debug.compile_backend=aot_eager"] if compiled else [])])


def _counting_device(trainer, counted_ref: list, buffers: set[int]):
    """threefold's Device seam with its host buffers remembered and its event waits counted as syncs."""
    from threefold.train.step import TorchDevice

    class Waited:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            if counted_ref:
                counted_ref[0].syncs.append("event.synchronize at train/step.py:PendingRead.values (the figures)")
            self.event.synchronize()

    class CountingDevice(TorchDevice):
        def host_buffer(self, numel):
            buffer = super().host_buffer(numel)
            buffers.add(buffer.untyped_storage().data_ptr())
            return buffer

        def record_event(self):
            return Waited(super().record_event())

    return CountingDevice(trainer.device.device)


def threefold_side(model: str, layers: int, seq: int, batch: int, compiled: bool) -> dict:
    """threefold's step (TrainStep) counted for operations and bytes, its whole step path for syncs."""
    import threefold.parallel.master as master
    from threefold.train.trainer import Trainer

    fused_on, master.fused_on = master.fused_on, lambda device: True  # the CUDA path's optimizer
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = Trainer(_threefold_config(model, layers, seq, batch, compiled, out))
            counted_ref, buffers = [], set()
            trainer.device = _counting_device(trainer, counted_ref, buffers)
            for _ in range(2):  # compiled, allocated, the optimizer's state made
                trainer.train_one_step()
            micro, _ = trainer.loader.get(trainer.step)
            with Counted() as step:
                trainer.step_fn(trainer.step + 1, micro, trainer.global_tokens)
            with Counted() as whole, HostReads(whole, buffers):
                counted_ref.append(whole)
                trainer.finish_step(trainer.launch_step())
            trainer.loader.close()
            params = sum(p.numel() for p in trainer.parallel.module.parameters())
            tokens = (micro[0].inputs.clone(), micro[0].targets.clone())
            del trainer
    finally:
        master.fused_on = fused_on
    gc.collect()
    outside = whole.by_source - step.by_source  # the step path's work around TrainStep, by source
    return dict(counts(step), whole_ops=whole.total_ops, syncs=whole.syncs, params=params, tokens=tokens,
                outside_step={f"{s} | {op}": n for (s, op), n in outside.items()})


def plain_side(model: str, layers: int, seq: int, compiled: bool, tokens: tuple) -> dict:
    """The plain loop's step on the same micro-batch: operations, bytes and syncs (its input copy included)."""
    s = dict(shape_of(MODELS[model][0]), layers=layers)
    s["max_seq"] = max(s["max_seq"], seq)
    plain = make_plain(s, torch.device("cpu"), compile=compiled, backend="aot_eager")
    groups = [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in plain.optimizer.param_groups]
    plain.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)  # the CUDA path's kernel
    inputs, targets = tokens
    for _ in range(2):
        plain.step(inputs, targets)
    with Counted() as step, HostReads(step, set()):
        plain.step(inputs.to(plain.device), targets.to(plain.device))
    params = sum(p.numel() for p in plain.model.parameters())
    del plain
    gc.collect()
    return dict(counts(step), whole_ops=step.total_ops, syncs=step.syncs, params=params)


def counts(c: Counted) -> dict:
    return dict(ops=c.total_ops, bytes=c.total_bytes, by_op=dict(c.ops), bytes_by_op=dict(c.bytes),
                by_source={f"{s} | {op}": n for (s, op), n in c.by_source.items()})


def loss_bytes_per_logit(which: str, dtype: torch.dtype, compiled: bool, rows: int = 64, vocab: int = 8192) -> dict:
    """Bytes per logit (and operations) of one forward and backward of the loss over (rows, vocab) logits."""
    import torch.nn.functional as F

    from threefold.models.cross_entropy import summed_cross_entropy

    def torchs(logits, targets):  # autocast's fp32 cast spelled out
        return F.cross_entropy(logits.float(), targets, reduction="sum")

    fn = summed_cross_entropy if which == "threefold" else torchs
    fn = torch.compile(fn, backend="aot_eager", dynamic=False) if compiled else fn
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    make = lambda: torch.randn(rows, vocab, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    fn(make(), targets).backward()
    logits = make()
    with Counted(sources=False) as c:
        fn(logits, targets).backward()
    return dict(bytes_per_logit=c.total_bytes / (rows * vocab), ops=c.total_ops, by_op=dict(c.ops),
                bytes_by_op={k: v / (rows * vocab) for k, v in c.bytes.items()})


def compare(model: str, layers: int, seq: int, batch: int, mode: str) -> dict:
    ours = threefold_side(model, layers, seq, batch, mode == "compiled")
    plain = plain_side(model, layers, seq, mode == "compiled", ours.pop("tokens"))
    return dict(model=model, layers=layers, seq=seq, batch=batch, mode=mode, threefold=ours, plain=plain,
                ops_ratio=ours["ops"] / plain["ops"], bytes_ratio=ours["bytes"] / plain["bytes"])


def extra_ops(row: dict, top: int) -> list[tuple[str, int, int]]:
    """The operations threefold issues more of than the plain loop: (name, threefold, plain), most first."""
    a, b = row["threefold"]["by_op"], row["plain"]["by_op"]
    names = sorted(set(a) | set(b), key=lambda k: b.get(k, 0) - a.get(k, 0))
    return [(k, a.get(k, 0), b.get(k, 0)) for k in names if a.get(k, 0) != b.get(k, 0)][:top]


def source_totals(by_source: dict) -> list[tuple[str, int]]:
    """Operations per source (`counts`' "source | op" keys), most first."""
    totals = collections.Counter()
    for key, n in by_source.items():
        totals[key.split(" | ")[0]] += n
    return totals.most_common()


def print_rows(rows: list[dict], losses: list[dict], top: int) -> None:
    print(f"{'model':11s} {'mode':8s} {'ops tf':>7s} {'ops plain':>9s} {'ratio':>6s} {'MB tf':>9s} {'MB plain':>9s} "
          f"{'ratio':>6s} {'whole ops tf':>12s} {'syncs tf':>8s} {'syncs plain':>11s}")
    for r in rows:
        t, p = r["threefold"], r["plain"]
        print(f"{r['model']:11s} {r['mode']:8s} {t['ops']:7d} {p['ops']:9d} {r['ops_ratio']:6.2f} "
              f"{t['bytes'] / 1e6:9.1f} {p['bytes'] / 1e6:9.1f} {r['bytes_ratio']:6.2f} {t['whole_ops']:12d} "
              f"{len(t['syncs']):8d} {len(p['syncs']):11d}")
    print("\nloss bytes per logit (forward + backward, 64 x 8192 logits)")
    for row in losses:
        print(f"  {row['dtype']:9s} {row['mode']:8s} threefold {row['threefold']['bytes_per_logit']:6.1f} "
              f"({row['threefold']['ops']} ops)  F.cross_entropy {row['torch']['bytes_per_logit']:6.1f} "
              f"({row['torch']['ops']} ops)  ratio {row['ratio']:.2f}")
    for r in rows:
        print(f"\n{r['model']} {r['mode']}: operations threefold has more of (name threefold plain)")
        for name, a, b in extra_ops(r, top):
            print(f"  {name:40s} {a:5d} {b:5d}")
        for side in ("threefold", "plain"):
            print(f"  {side} by source:", ", ".join(f"{s} {n}" for s, n in source_totals(r[side]["by_source"])))
        print("  threefold's step path outside TrainStep:",
              ", ".join(f"{k} {n}" for k, n in sorted(r["threefold"]["outside_step"].items())))
        print("  syncs threefold:", r["threefold"]["syncs"] or "none", "| plain:", r["plain"]["syncs"] or "none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-124m,llama-1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    torch.manual_seed(0)
    modes = a.modes.split(",")
    rows = [compare(m, a.layers, a.seq, a.batch, mode) for m in a.models.split(",") for mode in modes]
    losses = []
    for dtype in (torch.bfloat16, torch.float32):
        for mode in modes:
            ours, theirs = (loss_bytes_per_logit(w, dtype, mode == "compiled") for w in ("threefold", "torch"))
            losses.append(dict(dtype=str(dtype).removeprefix("torch."), mode=mode, threefold=ours, torch=theirs,
                               ratio=ours["bytes_per_logit"] / theirs["bytes_per_logit"]))
    print_rows(rows, losses, a.top)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(dict(steps=rows, loss=losses), indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
