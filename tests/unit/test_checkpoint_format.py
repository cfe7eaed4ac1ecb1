"""Checkpoint files on disk: atomic visibility, verification, hostile inputs, retention, tools."""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoint_layouts import local_entries, save_synthetic
from tests.unit.test_checkpoint_slices import GLOBAL, full_tensors, layout
from threefold.checkpoint import export_model, import_model
from threefold.checkpoint.format import (MANIFEST, CheckpointError, partial_dir_name, read_manifest,
                                         step_dir_name)
from threefold.checkpoint.pieces import local_pieces, local_view
from threefold.checkpoint.reader import load_entries
from threefold.checkpoint.state import (Entry, TrainingState, capture_rng, create_optimizer_state,
                                        restore_rng)
from threefold.checkpoint.verify import find_checkpoint_dir, verify
from threefold.checkpoint.writer import complete_checkpoints, remove_partials, snapshot, write_rank
from threefold.cli import main
from threefold.sharding import Placement


class Killed(Exception):
    pass


def test_checkpoint_killed_mid_write_never_becomes_visible(tmp_path):
    root = tmp_path / "checkpoints"
    save_synthetic(root, 2, layout("tp2-dp1"), full_tensors())
    partial = root / partial_dir_name(4)
    partial.mkdir()
    coords, places = layout("single")[0]
    entries = [Entry(n, full_tensors()[p.name], p) for n, p in places.items()]

    def die():
        raise Killed

    with pytest.raises(Killed):  # the process "dies" with half its file on disk
        write_rank(partial, 0, snapshot(entries, coords), {}, kill_midway=die)
    assert (partial / "rank-00000.safetensors").stat().st_size > 0
    assert [p.name for p in complete_checkpoints(root)] == [step_dir_name(2)]
    assert find_checkpoint_dir(tmp_path).name == step_dir_name(2)
    with pytest.raises(CheckpointError):
        read_manifest(partial)
    remove_partials(root)  # what the next save does first
    assert not partial.exists() and (root / step_dir_name(2)).is_dir()


def flip_byte(path: Path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_and_truncation_fail_verification_naming_the_file(tmp_path, capsys):
    ckpt = save_synthetic(tmp_path / "checkpoints", 3, layout("tp4-dp2"), full_tensors())
    manifest, problems = verify(ckpt)
    assert problems == [] and len(manifest.files) == 4
    assert main(["ckpt", "verify", str(ckpt)]) == 0
    assert "OK" in capsys.readouterr().out
    flip_byte(ckpt / "rank-00002.safetensors")
    _, problems = verify(ckpt)
    assert len(problems) == 1 and "rank-00002.safetensors" in problems[0] and "sha256" in problems[0]
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "rank-00002.safetensors" in capsys.readouterr().err
    with open(ckpt / "rank-00004.safetensors", "wb"):
        pass  # a stray file is not part of the checkpoint; a truncated listed one is
    path = ckpt / "rank-00000.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    _, problems = verify(ckpt)
    assert any("rank-00000.safetensors" in p and "truncated" in p for p in problems)
    (ckpt / "rank-00006.safetensors").unlink()
    _, problems = verify(ckpt)
    assert any("rank-00006.safetensors: missing" in p for p in problems)


def test_loading_never_unpickles_a_hostile_file(tmp_path, monkeypatch):
    """A pickle payload under a checkpoint file's name, with a manifest whose checksums match it."""
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    target = ckpt / "rank-00000.safetensors"
    target.write_bytes(pickle.dumps(Payload()))
    raw = json.loads((ckpt / MANIFEST).read_text())
    raw["files"]["rank-00000.safetensors"].update(bytes=target.stat().st_size,
                                                   sha256=hashlib.sha256(target.read_bytes()).hexdigest())
    (ckpt / MANIFEST).write_text(json.dumps(raw))

    def forbidden(*a, **k):
        raise AssertionError("pickle must never be used to load a checkpoint")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    problems = verify(ckpt)[1]  # checksums match: only the format check stands between it and us
    assert len(problems) == 1 and "not a loadable safetensors file" in problems[0], problems
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_entries(ckpt, manifest.tensors, local_entries(layout("single")[0][1]))
    with pytest.raises(CheckpointError):
        export_model(ckpt, tmp_path / "out.safetensors")
    assert not marker.exists()


def _manifest_variants(raw: dict):
    """Odd or hostile manifests; each must be refused with a CheckpointError."""
    name = "rank-00000.safetensors"
    tensor = next(iter(raw["tensors"]))

    def edit(fn):
        copy = json.loads(json.dumps(raw))
        fn(copy)
        return json.dumps(copy)

    yield "not json {"
    yield "[1, 2, 3]"
    yield "[" * 100_000 + "]" * 100_000
    yield edit(lambda m: m.update(format="pickle"))
    yield edit(lambda m: m.update(version=99))
    yield edit(lambda m: m.update(step=-1))
    yield edit(lambda m: m.update(step="10; rm -rf /"))
    yield edit(lambda m: m["files"].update({"../../etc/passwd": m["files"][name]}))
    yield edit(lambda m: m["files"].update({"/abs/rank-00001.safetensors": m["files"][name]}))
    yield edit(lambda m: m["files"][name].update(sha256="xyz"))
    yield edit(lambda m: m["tensors"][tensor].update(dtype="object"))
    yield edit(lambda m: m["tensors"][tensor].update(shape=[True, 2]))
    yield edit(lambda m: m["tensors"][tensor].update(shape=[1e9]))
    yield edit(lambda m: m["tensors"][tensor]["slices"][0].update(file="../rank-00000.safetensors"))
    yield edit(lambda m: m["tensors"][tensor]["slices"][0].update(offsets=[5]))
    yield edit(lambda m: m["tensors"][tensor]["slices"].append(m["tensors"][tensor]["slices"][0]))
    yield edit(lambda m: m["tensors"][tensor].update(slices=[]))
    yield edit(lambda m: m.update(rng={"zero": {}}))
    yield edit(lambda m: m.update(tensors=None))


def test_odd_or_hostile_manifests_are_refused_cleanly(tmp_path):
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    original = (ckpt / MANIFEST).read_text()
    raw = json.loads(original)
    for i, text in enumerate(_manifest_variants(raw)):
        (ckpt / MANIFEST).write_text(text)
        with pytest.raises(CheckpointError):
            read_manifest(ckpt)
        manifest, problems = verify(ckpt)
        assert manifest is None and problems, i
    (ckpt / MANIFEST).write_text(original)
    assert verify(ckpt)[1] == []


def test_the_manifest_is_written_by_json_s_c_encoder(tmp_path):
    """One line without indentation: json.dumps with `indent` runs its pure-Python encoder, which made
    each save's manifest 40 ms of a 4-rank tiny run's 850 ms (a 70B layout's manifest holds ~3,000
    tensors and ~25,000 slices); `threefold ckpt inspect --json` prints it indented for people."""
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    text = (ckpt / MANIFEST).read_text()
    assert "\n" not in text.strip() and ", " not in text and '": ' not in text
    assert read_manifest(ckpt).step == 1


def test_retention_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20):
        save_synthetic(root, step, layout("single"), full_tensors(step), keep=2)
    assert [p.name for p in complete_checkpoints(root)] == [step_dir_name(15), step_dir_name(20)]
    # saving a step that exists (e.g. one that failed verification) replaces it
    save_synthetic(root, 20, layout("tp2-dp1"), full_tensors(1), keep=2)
    assert read_manifest(root / step_dir_name(20)).layout == {"world_size": 2}


def test_export_import_and_inspect(tmp_path, capsys):
    fulls = full_tensors()
    named = {f"model/{n}": t for n, t in fulls.items()}
    ranks = [(c, {f"model/{n}": p for n, p in places.items()}) for c, places in layout("tp4zero-dp2")]
    for _, places in ranks:  # synthetic placements name the global tensor: use the checkpoint names
        for key, p in list(places.items()):
            places[key] = Placement(key, p.global_shape, p.offsets, p.shape, p.flat_range, p.replicated_over)
    ckpt = save_synthetic(tmp_path / "run" / "checkpoints", 7, ranks, named)
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(tmp_path / "run"), str(out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(out)
    assert set(exported) == set(GLOBAL)
    for name, full in fulls.items():
        assert torch.equal(exported[name], full)
    # import under another layout: each rank reads its boxes of the whole tensors
    for coords, places in layout("tp3zero-dp3"):
        params = [(n, torch.nn.Parameter(torch.zeros(p.numel()) if p.flat_range else torch.zeros(p.shape)))
                  for n, p in places.items()]
        import_model(out, params, places)
        for n, param in params:
            for piece in local_pieces(places[n]):
                region = tuple(slice(o, o + k) for o, k in zip(piece.offsets, piece.shape))
                assert torch.equal(local_view(param.detach(), places[n], piece), fulls[n][region])
    assert main(["ckpt", "inspect", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "step        7" in text and "model/embed" in text and "[10, 6]" in text
    assert main(["ckpt", "inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 7
    assert main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2


def test_optimizer_state_rng_and_extra_roundtrip(tmp_path):
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([param], lr=0.1, foreach=False)
    param.grad = torch.randn(4, 3)
    opt.step()

    class Scaler:
        def __init__(self, scale):
            self.scale = scale

        def state_dict(self):
            return {"scale": self.scale, "growth_tracker": 3}

        def load_state_dict(self, d):
            self.scale = d["scale"]

    place = {"w": Placement.whole("w", (4, 3)).replicated("dp")}
    state = TrainingState([("w", param)], place, opt, {"loss_scaler": Scaler(1024.0)})
    names = [e.name for e in state.entries()]
    assert names == ["model/w", "optim/w/step", "optim/w/exp_avg", "optim/w/exp_avg_sq"]
    rng = capture_rng(torch.device("cpu"))
    expected = torch.rand(3)
    root = tmp_path / "checkpoints"
    partial = root / partial_dir_name(1)
    partial.mkdir(parents=True)
    write_rank(partial, 0, snapshot(state.entries(), {"dp": 0}), rng)
    from threefold.checkpoint.writer import finalize

    ckpt = finalize(partial, 1, 1, {"extra": state.extra()}, keep=0, timeout_s=5)
    manifest = read_manifest(ckpt)
    assert manifest.extra == {"loss_scaler": {"scale": 1024.0, "growth_tracker": 3}}

    fresh = torch.nn.Parameter(torch.zeros(4, 3))
    opt2 = torch.optim.AdamW([fresh], lr=0.1, foreach=False)
    scaler2 = Scaler(1.0)
    state2 = TrainingState([("w", fresh)], place, opt2, {"loss_scaler": scaler2})
    create_optimizer_state(opt2, [("w", fresh)], place, manifest)
    load_entries(ckpt, manifest.tensors, state2.entries_to_load(manifest))
    state2.load_extra(manifest.extra)
    restore_rng(manifest.rng[0], torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)
    assert scaler2.scale == 1024.0 and torch.equal(fresh, param)
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state[fresh][key], opt.state[param][key])
    assert opt2.state[fresh]["step"].device.type == "cpu"
    # one more step from either gives the same bits
    fresh.grad = param.grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(fresh, param)
    shutil.rmtree(root)
