"""torch.distributed.checkpoint (DCP) directories, read under any layout.

A DCP directory (torch's `FileSystemWriter`: `.metadata` plus `*.distcp` files) holding a
torchtitan-style state dict - `{"model": {fqn: tensor}, "optimizer": flattened optimizer
state dict}` as `torch.distributed.checkpoint.state_dict.get_state_dict(...,
flatten_optimizer_state_dict=True)` makes it - is stored under flattened keys:

    model.<fqn>                              a parameter (torchtitan also writes the bare <fqn>)
    optimizer.state.<fqn>.<key>              AdamW's exp_avg, exp_avg_sq, step (SGD's momentum_buffer)
    optimizer.param_groups.<fqn>.<setting>   lr, betas, eps, weight_decay, ... (not read: the config rules)

Those map one to one onto threefold's checkpoint names `model/<fqn>` and `optim/<fqn>/<key>`
(`threefold_name`, `dcp_key`). Loading (`checkpoint.init_from`, `--resume`) asks DCP's own
loader, without a process group, for exactly the boxes this rank's placements hold: a load
planner turns each piece into read items over the stored chunks that overlap it
(`create_read_items_for_chunk_list`) and reads them straight into the local storage views, so
a rank reads only the chunks its slices touch and no byte moves between ranks. torch's side of it
(the planner, the load, the save) is dcp_io.py, imported only when a DCP directory is met.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from .format import DTYPE_NAMES, CheckpointError, Manifest, TensorInfo
from .pieces import local_pieces, local_view
from .reader import whole_tensor
from .state import Entry, TrainingState, model_entries
from .verify import find_checkpoint_dir, verify

METADATA = ".metadata"
MODEL = "model."
STATE = "optimizer.state."
# top-level keys of a torchtitan checkpoint that are not the model (whose keys it writes bare)
NOT_MODEL = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


def is_dcp(path: Path | str) -> bool:
    """Whether `path` is a DCP checkpoint directory (it holds torch's `.metadata` file)."""
    return Path(path).is_dir() and (Path(path) / METADATA).is_file()


def dcp_key(name: str) -> str:
    """threefold's checkpoint name -> the DCP key: model/<fqn> -> model.<fqn>, optim/<fqn>/<key> ->
    optimizer.state.<fqn>.<key>."""
    if name.startswith("model/"):
        return MODEL + name[len("model/"):]
    if name.startswith("optim/"):
        param, _, key = name[len("optim/"):].rpartition("/")
        return f"{STATE}{param}.{key}"
    raise ValueError(f"{name}: neither a model nor an optimizer tensor")


def threefold_name(key: str, bare_model: bool) -> str | None:
    """The DCP key -> threefold's name (None: not a model or optimizer-state tensor). `bare_model`:
    the directory keeps the model's keys at the top level (torchtitan), not under `model.`."""
    if key.startswith(MODEL):
        return "model/" + key[len(MODEL):]
    if key.startswith(STATE):
        param, _, state = key[len(STATE):].rpartition(".")
        return f"optim/{param}/{state}" if param else None
    if bare_model and not key.startswith(NOT_MODEL):
        return "model/" + key
    return None


class DcpIndex:
    """The tensors of a DCP directory by threefold name: their DCP key and storage metadata."""

    def __init__(self, path: Path):
        self.path = Path(path)
        from . import dcp_io  # torch.distributed.checkpoint costs seconds to import: only when one is read

        try:
            self.metadata = dcp_io.read_metadata(self.path)
        except Exception as e:  # torch raises whatever reading or unpickling raised
            raise CheckpointError(f"{self.where()}: not a readable torch.distributed.checkpoint metadata file "
                                  f"({type(e).__name__}: {e})") from None
        stored = self.metadata.state_dict_metadata
        bare = not any(k.startswith(MODEL) for k in stored)
        self.keys: dict[str, str] = {}  # threefold name -> DCP key
        for key, md in stored.items():
            name = threefold_name(key, bare)
            if name is not None and dcp_io.is_tensor(md):
                self.keys[name] = key

    def where(self) -> str:
        return str(self.path / METADATA)

    def storage(self, name: str):
        """The TensorStorageMetadata (global size, dtype, stored chunks) of tensor `name`."""
        return self.metadata.state_dict_metadata[self.keys[name]]

    def infos(self) -> dict[str, TensorInfo]:
        """{threefold name: global shape and dtype} (no slices: DCP's chunks are its own business)."""
        out = {}
        for name in self.keys:
            md = self.storage(name)
            dtype = DTYPE_NAMES.get(md.properties.dtype)
            if dtype is not None:
                out[name] = TensorInfo(tuple(md.size), dtype, ())
        return out

    def read(self, requests: list) -> None:
        """Boxes of stored tensors into local views: (DCP key, global offsets, shape, target view)."""
        from . import dcp_io

        dcp_io.read_boxes(self.path, requests)

    def check(self, entries: list[Entry]) -> None:
        """Every entry is stored, with the entry's global shape; else one line naming key and file."""
        for entry in entries:
            if entry.name not in self.keys:
                raise CheckpointError(f"{self.where()}: no tensor '{dcp_key(entry.name)}' (threefold's "
                                      f"{entry.name}); the model or optimizer differs from the one that wrote it")
            shape = tuple(self.storage(entry.name).size)
            if shape != tuple(entry.placement.global_shape):
                raise CheckpointError(f"{self.where()}: tensor '{self.keys[entry.name]}' has shape {list(shape)}, "
                                      f"the model expects {list(entry.placement.global_shape)}; use the model config "
                                      "the checkpoint was written with")


@torch.no_grad()
def load_dcp_entries(index: DcpIndex, entries: list[Entry]) -> None:
    """Fill every entry's local pieces (this rank's boxes only) from the DCP directory."""
    index.check(entries)
    requests = []
    for entry in entries:
        key = index.keys[entry.name]
        for piece in local_pieces(entry.placement):
            offsets, shape = piece.box
            requests.append((key, tuple(offsets), tuple(shape), local_view(entry.tensor, entry.placement, piece)))
    index.read(requests)


def _step(index: DcpIndex) -> int:
    """The optimizer steps taken: torchtitan's train_state.step, else AdamW's per-tensor step count."""
    stored = index.metadata.state_dict_metadata
    from . import dcp_io

    key = "train_state.step" if dcp_io.is_tensor(stored.get("train_state.step")) else next(
        (index.keys[n] for n in sorted(index.keys) if n.startswith("optim/") and n.endswith("/step")), None)
    if key is None or tuple(stored[key].size) != ():
        raise CheckpointError(f"{index.where()}: no step count (neither train_state.step nor an optimizer.state."
                              "<fqn>.step); resume needs the optimizer's state - start from the weights with "
                              "checkpoint.init_from instead")
    value = torch.zeros((), dtype=torch.float64)
    index.read([(key, (), (), value)])
    return int(round(float(value)))


def load_dcp(path: Path, state: TrainingState) -> Manifest:
    """Resume from a DCP directory: parameters and optimizer moments into this rank's slices, the step
    from the optimizer's count. The RNG keeps its seeded state and rank-local state is dropped (a DCP
    checkpoint carries neither); masters are taken from the loaded parameters."""
    index = DcpIndex(path)
    # the layout is DCP's own business; "written with format=dcp" is what a resume line shows
    manifest = Manifest(step=_step(index), layout={"format": "dcp"}, tensors=index.infos(), files={})
    load_dcp_entries(index, state.entries_to_load(manifest))
    state.load_extra({})
    return manifest


def import_dcp(path: Path, named_params, placements) -> None:
    """checkpoint.init_from a DCP directory: this rank's parameters from its `model` tensors."""
    load_dcp_entries(DcpIndex(path), model_entries(named_params, placements))


# ------------------------------------------------------------------ export


def _group_settings(train: dict, decay: bool) -> dict:
    """A parameter's optimizer settings as the installed torch's own optimizer holds them (every key
    its param_groups have, so that a plain `dcp.load` of its state dict finds each one)."""
    name = train.get("optimizer", "adamw")
    wd = float(train.get("weight_decay", 0.0)) if decay else 0.0
    probe = [torch.nn.Parameter(torch.zeros(1))]
    if name == "adamw":
        optimizer = torch.optim.AdamW(probe, lr=float(train["lr"]), betas=(float(train["beta1"]),
                                      float(train["beta2"])), eps=float(train["eps"]), weight_decay=wd)
    elif name == "sgd":
        optimizer = torch.optim.SGD(probe, lr=float(train["lr"]), momentum=float(train.get("momentum", 0.0)),
                                    nesterov=bool(train.get("nesterov", False)), weight_decay=wd)
    else:
        raise CheckpointError(f"ckpt export --dcp: the checkpoint's optimizer is {name!r}; DCP export writes "
                              "AdamW's or SGD's state (export the model alone: threefold ckpt export DIR OUT)")
    return {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}


def tied_names(manifest: Manifest) -> dict[str, str]:
    """{parameter: the parameter it shares storage with} of the model that wrote `manifest` (its spec's
    `tied`); {} when the writer's model cannot be built here (its state_dict then misses the alias)."""
    from ..config import ModelConfig
    from ..models.registry import model_spec

    try:
        return dict(model_spec(ModelConfig(**manifest.config.get("model", {})), 0).tied)
    except (UserError, OSError, TypeError):
        return {}


def dcp_state_dict(manifest: Manifest, read) -> dict:
    """{"model": {fqn: tensor}, "optimizer": flattened optimizer state dict} of a threefold checkpoint;
    `read(name)` assembles one global tensor. fp32 masters (bf16 runs) are not written: a plain
    optimizer keeps no copy beside the parameter."""
    model = {name[len("model/"):]: read(name) for name in sorted(manifest.tensors) if name.startswith("model/")}
    for alias, source in tied_names(manifest).items():  # a plain module's state_dict names both
        if source in model:
            model.setdefault(alias, model[source])
    states = [n for n in sorted(manifest.tensors) if n.startswith("optim/") and not n.endswith("/master")]
    if not states:
        return {"model": model}
    train = manifest.config.get("train", {})
    adamw = train.get("optimizer", "adamw") == "adamw"
    optimizer: dict = {}
    for name in states:
        fqn, _, key = name[len("optim/"):].rpartition("/")
        optimizer[f"state.{fqn}.{key}"] = read(name)
        if adamw:
            optimizer[f"state.{fqn}.step"] = torch.tensor(float(manifest.step))  # torch's AdamW count: fp32 scalar
    # every parameter's settings, frozen ones too: a plain optimizer over model.parameters() has them
    settings = {decay: _group_settings(train, decay) for decay in (False, True)}
    for name in sorted(manifest.tensors):
        if name.startswith("model/"):
            fqn = name[len("model/"):]
            for k, v in settings[len(manifest.tensors[name].shape) >= 2].items():
                optimizer[f"param_groups.{fqn}.{k}"] = v
    return {"model": model, "optimizer": optimizer}


def _check_new(out: Path) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"ckpt export --dcp: {out} exists and is not an empty directory; choose a new one")


def write_dcp(state_dict: dict, out: Path) -> None:
    """torch.distributed.checkpoint's own writer, from this one process (no process group)."""
    from . import dcp_io

    _check_new(out)
    dcp_io.save(state_dict, out)


def export_dcp(path: Path, out: Path) -> tuple[Path, int, int]:
    """Write checkpoint `path` (verified first) as a DCP directory `out`; returns (checkpoint, model
    tensors, optimizer state tensors)."""
    _check_new(out)  # before reading anything
    ckpt = find_checkpoint_dir(path)
    manifest, problems = verify(ckpt)
    if problems:
        raise CheckpointError(f"{ckpt} failed verification: {'; '.join(problems)}")

    state_dict = dcp_state_dict(manifest, lambda name: whole_tensor(ckpt, manifest, name))
    write_dcp(state_dict, out)
    states = sum(1 for k in state_dict.get("optimizer", {}) if k.startswith("state."))
    return ckpt, len(state_dict["model"]), states
