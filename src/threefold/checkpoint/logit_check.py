"""Conversion proven by logits: a Hugging Face directory against threefold's own forward.

`check_export(ckpt, out)` (after `ckpt export --hf`): transformers opens the exported directory
(`AutoModelForCausalLM.from_pretrained`, local files only) and threefold builds the checkpoint's
model from its own spec (models/registry.py, from the config the checkpoint recorded) with the
weights read by its own reader; both run the same fixed batch of token ids (`probe_tokens`: 4
sequences of 16, seeded, inside the vocabulary) and their logits are compared position by
position: ||ours - theirs|| / ||theirs|| over the vocabulary, the largest over the batch against
`BOUNDS[dtype]`. Both sides compute in fp32, whatever the stored dtype (bf16 weights are exact in
fp32), so what is left is the kernels' summation order: the families measure 0 to 1.3e-7 against a
bound of 1e-5. In bf16 both sides round every activation: the dense families measure 4e-3 to 8e-3,
Mixtral 4e-2 (a near tie in a router picks another expert at one token), hence the bound 5e-2 - and
a wrong export can hide under it (the rotary permutation dropped measures 2.6e-3 on the tests' tiny
Llama), which is why the check computes in fp32.
A mismatch names the worst (sequence, position) and removes the exported directory (rerun with
`--no-check` to keep it for inspection).

`check_pretrained(spec)` (train, before step 1): the weights of a `hf:DIR` run read by threefold's
reader into its whole model against transformers' forward of the directory; the trainer runs it on
rank 0 when the model has at most `PRETRAINED_CHECK_MAX_PARAMS` parameters (train/trainer.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..models.meta import on_meta
from ..models.spec import ModelSpec, empty_whole, retie
from ..sharding import Placement
from .format import CheckpointError, read_manifest
from .lora import is_lora
from .reader import load_entries
from .state import Entry
from .verify import find_checkpoint_dir

BOUNDS = {"float32": 1e-5, "bfloat16": 5e-2}  # the largest relative error of a position's logits, per precision
PROBE = (4, 16)  # sequences x tokens of the fixed batch
PRETRAINED_CHECK_MAX_PARAMS = 300_000_000  # above: a hf:DIR start is not checked (seconds would become minutes)


@dataclass(frozen=True)
class LogitCheck:
    what: str  # "export" or "init"
    max_rel: float  # the largest ||ours - theirs|| / ||theirs|| of a position's logits
    worst: tuple[int, int]  # its (sequence, position)
    shape: tuple[int, int]
    dtype: str

    @property
    def bound(self) -> float:
        return BOUNDS[self.dtype]

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.bound  # a NaN is not <= anything: it fails

    def line(self) -> str:
        tokens = f"{self.shape[0]}x{self.shape[1]} tokens"
        if self.ok:
            return (f"{self.what} check: logits match transformers, max relative error {self.max_rel:.1e} over "
                    f"{tokens} (bound {self.bound:.0e}, {self.dtype})")
        return (f"{self.what} check FAILED: logits differ from transformers at sequence {self.worst[0]} position "
                f"{self.worst[1]}: relative error {self.max_rel:.3g} > bound {self.bound:.0e} ({self.dtype}, "
                f"{tokens})")


def probe_tokens(vocab: int, shape: tuple[int, int] = PROBE) -> torch.Tensor:
    """The fixed batch: token ids in [0, vocab), the same for every run."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1234))


def compare(ours: torch.Tensor, theirs: torch.Tensor, what: str, dtype: str) -> LogitCheck:
    """Per position ||ours - theirs|| / ||theirs|| over the vocabulary, in fp64; the worst one."""
    if ours.shape != theirs.shape:
        raise CheckpointError(f"{what} check: threefold's logits are {list(ours.shape)}, transformers' "
                              f"{list(theirs.shape)}; the exported config.json does not describe the model")
    a, b = ours.double(), theirs.double()
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)  # NaN logits are the worst
    flat = int(rel.argmax())
    return LogitCheck(what, float(rel.max()), divmod(flat, rel.shape[1]), tuple(rel.shape), dtype)


def library_logits(directory: Path, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own forward of a model directory (local files only, no network)."""
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):  # the library's notes on unused weights and the like
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def _empty_model(spec: ModelSpec) -> nn.Module:
    """`spec`'s whole model on the CPU with storage but no values (buffers a family computes kept)."""
    model = empty_whole(spec, "cpu")
    retie(model, spec.tied)  # `to_empty` gave tied parameters storages of their own
    return model


def ours_logits(model: nn.Module, tokens: torch.Tensor, dtype: torch.dtype, vocab: int) -> torch.Tensor:
    model.to(dtype).eval()
    with torch.no_grad():
        return model(tokens)[..., :vocab].float()


def checkpoint_model(ckpt: Path, manifest) -> tuple[nn.Module, int]:
    """The checkpoint's model, whole, in fp32 (threefold's spec and reader); (model, vocabulary)."""
    from ..config import ModelConfig
    from ..models.registry import model_spec

    cfg = ModelConfig(**manifest.config.get("model", {}))
    spec = model_spec(cfg, 0)
    model = _empty_model(spec)
    entries, infos = [], {}
    for name, param in model.named_parameters():
        key = f"model/{name}"
        if key not in manifest.tensors:
            raise CheckpointError(f"{ckpt}: no tensor {key} for the model's parameter {name}")
        infos[key] = manifest.tensors[key]
        entries.append(Entry(key, param.data, Placement.whole(key, tuple(param.shape))))
    load_entries(ckpt, infos, entries)  # cast to the fp32 storage as they are copied
    return model, cfg.vocab


def check_export(path: Path, out: Path, dtype: str = "float32", remove: bool = True) -> LogitCheck | None:
    """Logits of the exported directory `out` (transformers) against checkpoint `path`'s (threefold); None
    when there is no model to compare (a LoRA checkpoint: its forward needs the base; docs/lora.md).
    A mismatch raises CheckpointError (exit 2) with the check's line, after removing `out` (`remove`)."""
    if dtype not in BOUNDS:
        raise CheckpointError(f"export check: dtype {dtype} has no bound; one of {', '.join(BOUNDS)}")
    ckpt = find_checkpoint_dir(path)
    manifest = read_manifest(ckpt)
    if is_lora(manifest) or not (Path(out) / "config.json").is_file():
        return None
    torch_dtype = getattr(torch, dtype)
    model, vocab = checkpoint_model(ckpt, manifest)
    tokens = probe_tokens(min(vocab, json.loads((Path(out) / "config.json").read_text())["vocab_size"]))
    ours = ours_logits(model, tokens, torch_dtype, vocab)
    del model
    check = compare(ours, library_logits(Path(out), tokens, torch_dtype), "export", dtype)
    if not check.ok:
        if remove:
            shutil.rmtree(out)
        raise CheckpointError(check.line() + (f"; removed {out} (export with --no-check to keep it)" if remove else ""))
    return check


def check_pretrained(spec: ModelSpec, vocab: int, dtype: str = "float32") -> LogitCheck:
    """The weights of a Hugging Face directory (`spec.weights`, read by threefold's reader into its whole
    model) against transformers' forward of the directory, on the fixed batch."""
    directory = spec.hf.source
    model = _empty_model(spec)
    named = list(model.named_parameters())
    spec.weights.load(named, {name: Placement.whole(name, tuple(p.shape)) for name, p in named})
    torch_dtype = getattr(torch, dtype)
    tokens = probe_tokens(vocab)
    ours = ours_logits(model, tokens, torch_dtype, vocab)
    del model
    return compare(ours, library_logits(directory, tokens, torch_dtype), "init", dtype)


def pretrained_check_line(spec: ModelSpec, vocab: int) -> str:
    """The trainer's check of a `hf:DIR` start (rank 0, before step 1): its line, or the line saying why it
    was skipped (more than PRETRAINED_CHECK_MAX_PARAMS parameters: loading the directory twice more and a
    forward on the host would cost minutes); CheckpointError (exit 2) when the logits differ."""
    with on_meta():
        count = sum(p.numel() for p in spec.build().parameters())
    if count > PRETRAINED_CHECK_MAX_PARAMS:
        return (f"init check skipped: {count:,} parameters, above {PRETRAINED_CHECK_MAX_PARAMS:,} (the check "
                "loads the model twice on the host); the reader is the one `ckpt export --hf` checks")
    check = check_pretrained(spec, vocab)
    if not check.ok:
        raise CheckpointError(f"{check.line()}: threefold's {spec.family} does not reproduce {spec.hf.source} "
                              "(a transformers version whose modelling changed?); nothing was trained")
    return check.line()
