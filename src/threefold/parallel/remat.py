"""Activation checkpointing: keep fewer activations for backward, recompute the rest.

Step 3 of `parallelize`. A checkpointed region runs its forward without saving anything for
backward but its inputs; when backward reaches it, the region's forward runs again
(torch.utils.checkpoint, non-reentrant) and its backward proceeds from the recomputed tensors.
Policies (`remat.policy`):

    none        save everything (fastest, most memory)
    full        every transformer block (`blocks.<i>`) is a region: only block inputs are kept
    every-k     blocks whose index is a multiple of `remat.every` are regions
    selective   only the named parts of each block (`remat.targets`; by default the family's own,
                `ModelSpec.selective`: the reference decoder's `attn.core`, the softmax attention whose
                saved state grows with seq_len^2 but is cheap to redo; a Hugging Face model's attention
                module)

Results are bit-identical to no checkpointing: the recomputation repeats the same kernels on
the same inputs (and the RNG state is restored for it).

Regions are found by name (the model contract: blocks.<i>, blocks.<i>.attn, ...), and wrapped
from outside by replacing the module's `forward` (or the named method) on the instance, so
module hooks of later strategies (ZeRO-3's gather/free) still run around the whole region.

Activation offload (`remat.offload=cpu`, `apply_offload` below) keeps what the chosen blocks save
for backward in host memory. Each chosen block's forward runs inside saved-tensor hooks
(torch.autograd.graph.saved_tensors_hooks, the mechanism of torch's own save_on_cpu) wrapped
around whatever the policy made of it, so it composes with every policy: alone it moves all the
block saves; with `full` (and every-k's checkpointed blocks) the block input the checkpoint keeps;
with `selective` what selective still saves (the checkpointed core's inputs included; the core's
internals are never saved, and its recomputation in backward saves nothing the hooks see).
What moves: every saved tensor's whole storage, once per block call however many views of it are
saved (views are rebuilt on the way back, with their sizes, strides and offsets), except the
block's parameters and buffers (and any view of them): those stay where they are.
On CUDA the host copies are pinned and issued on a side stream once the compute stream has made
the tensor; when a block's backward starts (its first saved tensor is asked for) its copies come
back on the side stream, and those of the block before it (the next to run backward) are
prefetched behind them. On the CPU the same path runs with plain host buffers: a copy into a
separate buffer at save, and a copy back at the backward, so tests exercise it.
"Device" activation bytes (what the meter of observe/memory.py counts, the trainer's
`mem.activations`) are then the saved bytes the hooks did not move; the moved ones are
`ActivationOffload.host_peak` (`mem.activations_host`): the most host bytes held at once.
"""

from __future__ import annotations

import functools
import re
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import RematConfig
from ..config.sections import offload_block_set
from ..errors import ConfigError
from ..models.forwards import recomputing

BLOCK = re.compile(r"(?:.*\.)?blocks\.(\d+)")
_WRAPPED: weakref.WeakSet = weakref.WeakSet()  # the regions' wrappers, so a region is never wrapped twice


def checkpointed(fn):
    """`fn` as a checkpointed region (a no-op wrapper when autograd is off)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        # non-reentrant: the inputs are saved through autograd's saved-tensor mechanism (so
        # activation accounting sees exactly what is kept), and the region may use autograd
        # hooks of other strategies (ZeRO-3) during the recomputation
        return checkpoint(_marking_recomputation(fn), *args, use_reentrant=False, **kwargs)

    _WRAPPED.add(run)
    return run


def _marking_recomputation(fn):
    """`fn` whose second and later runs (the recomputations) run inside models.forwards.recomputing(),
    so modules with side effects (the router's tally) do not count them again."""
    runs = 0

    def region(*args, **kwargs):
        nonlocal runs
        if torch.compiler.is_compiling():  # traced once; the compiled backward recomputes without Python
            return fn(*args, **kwargs)
        runs += 1
        if runs == 1:
            return fn(*args, **kwargs)
        with recomputing():
            return fn(*args, **kwargs)

    return region


def blocks_of(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer index, name, module) of every transformer block, in order."""
    out = []
    for name, module in model.named_modules():
        match = BLOCK.fullmatch(name)
        if match:
            out.append((int(match.group(1)), name, module))
    return sorted(out, key=lambda t: t[0])


def _wrap_forward(module: nn.Module) -> None:
    if module.forward not in _WRAPPED:
        module.forward = checkpointed(module.forward)


def block_parts(block: nn.Module, depth: int = 2) -> list[str]:
    """The names a selective target can take in `block`: its submodules down to `depth` levels."""
    return [name for name, _ in block.named_modules() if name and name.count(".") < depth]


def _wrap_target(block_name: str, block: nn.Module, target: str) -> str:
    """Wrap `target` (a submodule path or `path.method`) inside `block`; returns its full name."""
    full = f"{block_name}.{target}"
    try:
        module = block.get_submodule(target)
        _wrap_forward(module)
        return full
    except AttributeError:
        pass
    owner_path, _, method = target.rpartition(".")
    try:
        owner = block.get_submodule(owner_path) if owner_path else block
    except AttributeError:
        owner = None
    fn = getattr(owner, method, None) if owner is not None else None
    if not callable(fn) or isinstance(fn, nn.Module):
        parts = ", ".join(block_parts(block))
        raise ConfigError("remat.targets", f"'{target}' is neither a submodule nor a method of {block_name}; "
                          f"name parts of this model's blocks: {parts}")
    if fn not in _WRAPPED:
        setattr(owner, method, checkpointed(fn))
    return full


def apply_remat(model: nn.Module, cfg: RematConfig, family_targets: tuple[str, ...] = ("attn.core",)) -> list[str]:
    """Wrap the regions `cfg.policy` selects; returns their names. `family_targets`: what selective
    recomputes when remat.targets is empty (the model family's ModelSpec.selective)."""
    if cfg.policy == "none":
        return []
    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError("remat.policy", f"'{cfg.policy}' needs transformer blocks named blocks.<i>; "
                          "this model has none (use remat.policy=none)")
    regions = []
    if cfg.policy in ("full", "every-k"):
        for index, name, block in blocks:
            if cfg.policy == "full" or index % cfg.every == 0:
                _wrap_forward(block)
                regions.append(name)
    elif cfg.policy == "selective":
        targets = [t.strip() for t in cfg.targets.split(",") if t.strip()] or list(family_targets)
        for _, name, block in blocks:
            regions += [_wrap_target(name, block, t) for t in targets]
    return regions


# ------------------------------------------------------------------ activation offload


@dataclass
class _Stored:
    """One storage a block saved: its host copy until it is brought back, then the device copy."""

    nbytes: int
    device: torch.device
    host: torch.Tensor | None = None  # uint8, the storage's bytes
    back: torch.Tensor | None = None  # uint8 on `device`: the storage again
    ready: object | None = None  # CUDA event: `back` is complete


@dataclass(eq=False)
class _Window:
    """What one forward call of one block saved, by storage."""

    block: int
    stored: dict[int, _Stored] = field(default_factory=dict)
    sources: list[torch.Tensor] = field(default_factory=list)  # kept until the forward leaves the block
    previous: weakref.ref | None = None  # the block called before it in the same forward: next in backward
    started: bool = False  # its backward has asked for a saved tensor
    fetched: bool = False  # its copies are on their way back (or back)
    __weakref__: object = None


@dataclass(eq=False)
class _Saved:
    """What autograd keeps for one saved tensor: where its storage went and how to view it again."""

    window: _Window
    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class OffloadTimes:
    """Seconds and bytes of the copies (host clock on the CPU; CUDA events on a GPU, read on `timings`)."""

    to_host_s: float = 0.0
    to_device_s: float = 0.0
    bytes_to_host: int = 0
    bytes_to_device: int = 0


class ActivationOffload:
    """The saved-tensor hooks of `remat.offload=cpu` and their bookkeeping (one per model).

    `host_bytes` is what is held in host copies now, `host_peak` the most held at once since the
    last `reset_peak()`; `times` accumulates the copies' time (CUDA: per copy a pair of events on the
    side stream, summed by `timings()`; the overlap is then the part of that time the step did not wait).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.host_bytes = 0
        self.host_peak = 0
        self.times = OffloadTimes()
        self._events: list[tuple[str, object, object]] = []  # CUDA: (direction, start, end) not yet read
        self._last: weakref.ref | None = None  # the window opened last (the block before the next one)

    def reset_peak(self) -> None:
        self.host_peak = self.host_bytes

    # ------------------------------------------------------------ the block wrapper

    def wrap(self, index: int, block: nn.Module, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            window = _Window(index)
            last = self._last() if self._last is not None else None
            if last is not None and last.block == index - 1:  # the same forward, one block on (a pipeline's
                # other chunks and micro-batches never follow their block's predecessor on this rank)
                window.previous = self._last
            self._last = weakref.ref(window)
            kept = {t.untyped_storage()._cdata for t in block.buffers()}
            hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, window, block, kept),
                                                             self._unpack)
            try:
                with hooks:
                    return fn(*args, **kwargs)
            finally:
                window.sources.clear()  # the storages may go now (CUDA: record_stream keeps them for the copy)

        _OFFLOADED.add(run)
        return run

    # ------------------------------------------------------------ pack: to the host

    def _pack(self, window: _Window, block: nn.Module, kept: set[int], t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided or isinstance(t, nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        if key in kept or key in {q.untyped_storage()._cdata for q in block.parameters()}:  # (ZeRO-3's whole forms)
            return t
        if key not in window.stored:
            window.sources.append(t)  # the storage object stays alive (and its key unique) through the block
            window.stored[key] = self._to_host(storage, t.device)
            self.host_bytes += storage.nbytes()
            self.host_peak = max(self.host_peak, self.host_bytes)
        return _Saved(window, key, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _to_host(self, storage, device: torch.device) -> _Stored:
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        entry = _Stored(storage.nbytes(), device)
        if device.type == "cuda":
            entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the tensor is made
            with torch.cuda.stream(self.stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                entry.host.copy_(src, non_blocking=True)
                end.record()
            src.record_stream(self.stream)  # not reused by the compute stream before the copy is done
            self._events.append(("to_host", start, end))
        else:
            begin = time.perf_counter()
            entry.host = torch.empty(entry.nbytes, dtype=torch.uint8)
            entry.host.copy_(src)
            self.times.to_host_s += time.perf_counter() - begin
        self.times.bytes_to_host += entry.nbytes
        return entry

    # ------------------------------------------------------------ unpack: back, ahead of the backward

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        window = saved.window
        if not window.started:  # the block's backward starts: its copies (if not prefetched), then the next's
            self._start(window)
        entry = window.stored[saved.key]
        if entry.ready is not None:
            torch.cuda.current_stream(entry.device).wait_event(entry.ready)
        return torch.empty(0, dtype=saved.dtype, device=entry.device).set_(
            entry.back.untyped_storage(), saved.offset, saved.size, saved.stride)

    def _start(self, window: _Window) -> None:
        window.started = True
        if not window.fetched:
            self._fetch(window)
        previous = window.previous() if window.previous is not None else None
        if previous is not None and not previous.fetched:
            self._fetch(previous)  # the next block's backward: its copies queue behind these

    def _fetch(self, window: _Window) -> None:
        window.fetched = True
        for entry in window.stored.values():
            if entry.device.type == "cuda":
                with torch.cuda.stream(self.stream):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    entry.back = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
                    entry.back.copy_(entry.host, non_blocking=True)
                    end.record()
                entry.back.record_stream(torch.cuda.current_stream(entry.device))
                entry.ready = end
                self._events.append(("to_device", start, end))
            else:
                begin = time.perf_counter()
                entry.back = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
                entry.back.copy_(entry.host)
                self.times.to_device_s += time.perf_counter() - begin
            self.times.bytes_to_device += entry.nbytes
            entry.host = None  # the host copy is done with (CUDA: the pinned allocator waits for the copy)
            self.host_bytes -= entry.nbytes

    def timings(self) -> OffloadTimes:
        """`times` with the CUDA copies so far added (synchronises on their events; call outside the step)."""
        for direction, start, end in self._events:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
            if direction == "to_host":
                self.times.to_host_s += seconds
            else:
                self.times.to_device_s += seconds
        self._events.clear()
        return self.times


_OFFLOADED: weakref.WeakSet = weakref.WeakSet()  # the offload wrappers, so a block is never wrapped twice


def apply_offload(model: nn.Module, cfg: RematConfig, device: torch.device) -> ActivationOffload | None:
    """Wrap the forward of every block `remat.offload_blocks` chooses (this rank's, by global index) in
    the offload's hooks, around what apply_remat made of it: call after apply_remat."""
    if cfg.offload == "none":
        return None
    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError("remat.offload", "needs transformer blocks named blocks.<i>; this model has none "
                          "(use remat.offload=none)")
    chosen = offload_block_set(cfg.offload_blocks, 1 << 62)  # checked against model.layers by config/checks.py
    offload = ActivationOffload(device)
    for index, _, block in blocks:
        if (chosen is None or index in chosen) and block.forward not in _OFFLOADED:
            block.forward = offload.wrap(index, block, block.forward)
    return offload
