"""Distributed, universal checkpoints: each rank writes what it owns, any layout loads any checkpoint.

    format.py        directory names, the JSON manifest and its strict validation
    pieces.py        slice arithmetic on placements: held boxes and their storage views
    state.py         the training state as named entries (model, optimizer), RNG, extra state
    writer.py        snapshot, per-rank file, atomic finalize, retention, background writer
    reader.py        universal load: read only the overlapping slices
    verify.py        checksums, completeness, which checkpoint to resume from
    checkpointer.py  the distributed orchestration (save / resume / load)
    peer.py          in-memory copies on this node's and a peer node's launcher (checkpoint.peer_copy)
    peer_wire.py     the keeper's wire format: challenge, signed request, reply
    export.py        one Hugging Face-style safetensors file: export and import
    dcp.py           torch.distributed.checkpoint directories in and out (names, this rank's boxes)
    dcp_io.py        torch's side of it, imported only when a DCP directory is met
    command.py       `threefold ckpt inspect | verify | export [--hf | --dcp]`
"""

from .checkpointer import Checkpointer
from .export import export_model, import_model
from .format import CheckpointError, Manifest, read_manifest
from .state import Entry, TrainingState
from .verify import find_checkpoint_dir, verify

__all__ = ["Checkpointer", "CheckpointError", "Entry", "Manifest", "TrainingState", "export_model",
           "find_checkpoint_dir", "import_model", "read_manifest", "verify"]
