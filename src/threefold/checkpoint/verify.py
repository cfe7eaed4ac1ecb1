"""Verification (completeness, sizes, sha256) and the choice of the checkpoint to resume from."""

from __future__ import annotations

from pathlib import Path

from .format import MANIFEST, CheckpointError, Manifest, read_manifest, step_of
from .writer import complete_checkpoints, file_sha256


def find_checkpoint_dir(path: Path) -> Path:
    """A checkpoint directory from a step directory, a checkpoints/ root or a run directory (newest)."""
    path = Path(path)
    if (path / MANIFEST).is_file() or step_of(path) is not None:
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(f"{path}: no checkpoint here (expected a step-NNNNNNNN directory, a checkpoints/ "
                          "directory or a run directory containing one)")


def verify_files(ckpt: Path, manifest: Manifest, files: list[str] | None = None) -> list[str]:
    """Problems with the listed data files (all when `files` is None): missing, truncated, altered."""
    problems = []
    for name in (sorted(manifest.files) if files is None else files):
        info = manifest.files[name]
        path = Path(ckpt) / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != info.bytes:
            problems.append(f"{path}: {size} bytes, the manifest says {info.bytes} (truncated or altered)")
            continue
        if file_sha256(path) != info.sha256:
            problems.append(f"{path}: sha256 mismatch (the file is corrupt)")
    return problems


def verify(ckpt: Path) -> tuple[Manifest | None, list[str]]:
    """Check one checkpoint completely; returns its manifest (None if unreadable) and the problems."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return None, [str(e)]
    problems = verify_files(ckpt, manifest)
    step = step_of(Path(ckpt))
    if step is not None and step != manifest.step:
        problems.append(f"{ckpt}: directory says step {step}, manifest says {manifest.step}")
    return manifest, problems
