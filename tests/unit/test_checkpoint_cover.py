"""A checkpoint with a hole never loads, and verify means loadable: exact cover checks for any
number of slices, safetensors headers checked against the manifest, no symbolic links, no
repeated JSON keys, no allocation for shapes the stored bytes do not back."""

import hashlib
import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.checkpoint_layouts import local_entries, save_synthetic, tp_split, zero_shard
from tests.unit.test_checkpoint_slices import full_tensors, layout
from threefold.checkpoint import export_model
from threefold.checkpoint.format import (MANIFEST, CheckpointError, FileInfo, Manifest, Slice, TensorInfo,
                                         first_overlap, parse_manifest, partial_dir_name, read_manifest,
                                         step_dir_name)
from threefold.checkpoint.pieces import local_pieces
from threefold.checkpoint.reader import load_entries
from threefold.checkpoint.verify import verify
from threefold.checkpoint.writer import finalize
from threefold.cli import main


# ---------------------------------------------------------------------- the overlap test itself

def brute_overlap(boxes) -> bool:
    for (ao, ae), (bo, be) in itertools.combinations(boxes, 2):
        if math.prod(ae) and math.prod(be) and all(max(x, y) < min(x + p, y + q)
                                                   for x, p, y, q in zip(ao, ae, bo, be)):
            return True
    return False


def random_box(rng: random.Random, shape):
    offsets = tuple(rng.randrange(s) for s in shape)
    return offsets, tuple(rng.randint(0 if rng.random() < 0.1 else 1, s - o) for o, s in zip(offsets, shape))


def test_first_overlap_agrees_with_the_pairwise_check_on_random_boxes():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        boxes = [random_box(rng, shape) for _ in range(rng.randint(0, 6))]
        pair = first_overlap(shape, boxes)
        assert (pair is not None) == brute_overlap(boxes), (shape, boxes)
        if pair is not None:
            found += 1
            assert brute_overlap([boxes[pair[0]], boxes[pair[1]]]), (shape, boxes, pair)
    assert 300 < found < 2700  # both outcomes are well represented


def tiling(shape, rng: random.Random):
    """A random exact tiling of `shape`: recursive guillotine cuts."""
    out = []

    def cut(offsets, extent, depth):
        dims = [d for d, e in enumerate(extent) if e > 1]
        if not dims or depth > 6 or rng.random() < 0.15:
            out.append((offsets, extent))
            return
        d = rng.choice(dims)
        at = rng.randint(1, extent[d] - 1)
        cut(offsets, extent[:d] + (at,) + extent[d + 1:], depth + 1)
        cut(offsets[:d] + (offsets[d] + at,) + offsets[d + 1:], extent[:d] + (extent[d] - at,) + extent[d + 1:],
            depth + 1)

    cut((0,) * len(shape), tuple(shape), 0)
    return out


def test_tilings_pass_and_any_moved_box_is_caught():
    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.randint(2, 9) for _ in range(rng.randint(1, 4)))
        boxes = tiling(shape, rng)
        assert first_overlap(shape, boxes) is None
        if len(boxes) > 1:  # one box replaced by a copy of another: a hole and a duplicate
            i, j = rng.sample(range(len(boxes)), 2)
            broken = list(boxes)
            broken[i] = boxes[j]
            assert first_overlap(shape, broken) is not None


def strategy_boxes(shape, tp_dim, tp, dp):
    """Every box the ranks of a tp x ZeRO layout write for one tensor."""
    return [piece.box for part in tp_split("t", shape, tp_dim, tp, math.ceil(shape[tp_dim] / tp) * tp)
            for shard in zero_shard(part, dp) for piece in local_pieces(shard)]


@pytest.mark.parametrize("shape,tp_dim,tp,dp", [((3000,), 0, 1, 600), ((37, 64), 1, 4, 200), ((37, 64), 0, 3, 300),
                                                ((8, 10, 36), 2, 2, 300), ((8, 10, 36), 1, 2, 300)])
def test_the_boxes_of_many_ranks_pass_and_one_hole_one_duplicate_fails(shape, tp_dim, tp, dp):
    boxes = [b for b in strategy_boxes(shape, tp_dim, tp, dp) if math.prod(b[1])]
    assert len(boxes) > 512 and sum(math.prod(e) for _, e in boxes) == math.prod(shape)
    assert first_overlap(shape, boxes) is None
    broken = list(boxes)
    broken[len(boxes) // 3] = boxes[len(boxes) // 3 + 1]
    assert first_overlap(shape, broken) is not None


# ---------------------------------------------------------------------- crafted checkpoints

def write_checkpoint(ckpt: Path, tensors: dict[str, tuple[tuple[int, ...], list]], values: dict[str, torch.Tensor]):
    """A checkpoint of one file whose tensor `name` has the slices [(offsets, shape, key)] of the
    global `values[name]` - as the manifest says, whether or not they tile it."""
    ckpt.mkdir(parents=True)
    stored, slices = {}, {}
    for name, (shape, boxes) in tensors.items():
        slices[name] = []
        for offsets, extent, key in boxes:
            region = tuple(slice(o, o + e) for o, e in zip(offsets, extent))
            stored[key] = values[name][region].clone()
            slices[name].append(Slice("rank-00000.safetensors", key, offsets, extent))
    path = ckpt / "rank-00000.safetensors"
    save_file(stored, str(path))
    manifest = Manifest(step_of_dir(ckpt), {"world_size": 1},
                        {n: TensorInfo(shape, "float32", tuple(slices[n])) for n, (shape, _) in tensors.items()},
                        {path.name: FileInfo(0, path.stat().st_size, sha(path))}, config={"model": {}})
    (ckpt / MANIFEST).write_text(manifest.to_json())
    return ckpt


def step_of_dir(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(ckpt: Path, fn) -> None:
    raw = json.loads((ckpt / MANIFEST).read_text())
    fn(raw)
    (ckpt / MANIFEST).write_text(json.dumps(raw))


def flat_ranges(n: int, parts: int):
    size = n // parts
    return [((i * size,), (size,), f"model/w@{i * size}") for i in range(parts)]


def test_over_512_slices_with_one_hole_and_one_duplicate_never_verify_load_or_export(tmp_path, capsys):
    n, parts = 2400, 600
    values = {"model/w": torch.arange(n, dtype=torch.float32)}
    good = write_checkpoint(tmp_path / "good" / step_dir_name(1), {"model/w": ((n,), flat_ranges(n, parts))}, values)
    assert verify(good)[1] == []
    boxes = flat_ranges(n, parts)
    boxes[100] = (boxes[101][0], boxes[101][1], "model/w@dup")  # elements 400-403 missing, 404-407 twice
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints" / step_dir_name(1), {"model/w": ((n,), boxes)}, values)
    with pytest.raises(CheckpointError, match="overlap at"):
        read_manifest(ckpt)
    assert main(["ckpt", "verify", str(ckpt)]) == 1
    assert "overlap" in capsys.readouterr().err
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="overlap"):
        export_model(ckpt, out)
    assert not out.exists()  # refused before writing anything


def test_the_writers_self_check_catches_a_hole_and_a_duplicate_among_many_slices(tmp_path):
    root = tmp_path / "checkpoints"
    partial = root / partial_dir_name(1)
    partial.mkdir(parents=True)
    boxes = flat_ranges(2400, 600)
    boxes[7] = boxes[8][0], boxes[8][1], "model/w@dup"
    part = {"rank": 0, "rng": {}, "file": {"name": "rank-00000.safetensors", "bytes": 1, "sha256": "0" * 64},
            "tensors": [{"name": "model/w", "global_shape": [2400], "dtype": "float32", "key": key,
                         "offsets": list(o), "shape": list(e)} for o, e, key in boxes]}
    (partial / "rank-00000.part.json").write_text(json.dumps(part))
    with pytest.raises(CheckpointError, match="overlap.*do not tile"):
        finalize(partial, 1, 1, {}, keep=0, timeout_s=5)
    assert not (root / step_dir_name(1)).exists()


def test_export_fills_zeros_never_uninitialised_memory(tmp_path, monkeypatch):
    import threefold.checkpoint.reader as reader_module  # where the export's whole tensors are allocated

    values = {"model/w": torch.arange(8, dtype=torch.float32)}
    ckpt = write_checkpoint(tmp_path / step_dir_name(1), {"model/w": ((8,), [((0,), (8,), "model/w@0")])}, values)

    class NoEmpty:  # torch as the reader module sees it, without torch.empty
        def __getattr__(self, name):
            if name == "empty":
                pytest.fail("export allocates with torch.empty (uninitialised memory)")
            return getattr(torch, name)

    monkeypatch.setattr(reader_module, "torch", NoEmpty())
    export_model(ckpt, tmp_path / "out.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], values["model/w"])


def test_repeated_json_keys_in_a_manifest_are_refused(tmp_path):
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text.replace("{", '{"step": 99, ', 1))
    with pytest.raises(CheckpointError, match="'step' appears twice"):
        read_manifest(ckpt)
    (ckpt / MANIFEST).write_text(text)
    assert verify(ckpt)[1] == []


def test_symbolic_links_inside_a_checkpoint_are_refused(tmp_path):
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    data = ckpt / "rank-00000.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    data.rename(outside)
    data.symlink_to(outside)  # the same bytes: size and sha256 match
    problems = verify(ckpt)[1]
    assert len(problems) == 1 and "symbolic link" in problems[0], problems
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_entries(ckpt, manifest.tensors, local_entries(layout("single")[0][1]))
    data.unlink()
    outside.rename(data)
    real = ckpt / MANIFEST
    moved = tmp_path / "manifest.json"
    real.rename(moved)
    real.symlink_to(moved)
    with pytest.raises(CheckpointError, match="symbolic link"):
        read_manifest(ckpt)


# ---------------------------------------------------------------------- verify means loadable

def rewrite_file(ckpt: Path, name: str, blob: bytes) -> None:
    """Replace a data file, the manifest's size and sha256 updated to match (a crafted checkpoint)."""
    (ckpt / name).write_bytes(blob)
    edit_manifest(ckpt, lambda m: m["files"][name].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest()))


def header_of(blob: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def crafted_variants():
    """(what, change to a checkpoint written by `layout("single")`, expected verify message)."""
    name = "rank-00000.safetensors"

    def garbage(ckpt):
        rewrite_file(ckpt, name, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + bytes(64))

    def lying_offsets(ckpt):
        header, data = header_of((ckpt / name).read_bytes())
        keys = [k for k in header if k != "__metadata__" and header[k]["shape"] == [10, 6]]
        other = next(k for k in header if k != "__metadata__" and k not in keys)
        header[other]["data_offsets"] = header[keys[0]]["data_offsets"][:1] * 2  # zero length, same start
        header[other]["shape"] = [0]
        rewrite_file(ckpt, name, with_header(header, data))

    def overlapping_offsets(ckpt):
        header, data = header_of((ckpt / name).read_bytes())
        a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
        end = header[a]["data_offsets"][1]
        header[b]["data_offsets"] = [end - 4, header[b]["data_offsets"][1] - 4]
        rewrite_file(ckpt, name, with_header(header, data))

    def key_missing(ckpt):
        edit_manifest(ckpt, lambda m: m["tensors"]["embed"]["slices"][0].update(key="embed@nowhere"))

    def wrong_dtype(ckpt):
        edit_manifest(ckpt, lambda m: m["tensors"]["bias"].update(dtype="float64"))

    def repeated_header_key(ckpt):
        blob = (ckpt / name).read_bytes()
        n = int.from_bytes(blob[:8], "little")
        text = blob[8:8 + n].decode()
        first = text.index('"', 2)
        entry_key = text[1:first + 1]  # the first entry's quoted key
        doubled = text.replace("{", "{" + entry_key + ': {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, ', 1)
        rewrite_file(ckpt, name, len(doubled).to_bytes(8, "little") + doubled.encode() + blob[8 + n:])

    yield "garbage", garbage, "not a loadable safetensors file"
    yield "lying offsets", lying_offsets, "not a loadable safetensors file"
    yield "overlapping offsets", overlapping_offsets, "not a loadable safetensors file"
    yield "key missing", key_missing, "has no tensor 'embed@nowhere'"
    yield "wrong dtype", wrong_dtype, "the manifest says float64"
    yield "repeated header key", repeated_header_key, "appears twice"


@pytest.mark.parametrize("what,change,message", list(crafted_variants()), ids=lambda v: v if isinstance(v, str) else "")
def test_verify_parses_every_header_and_checks_it_against_the_manifest(tmp_path, capsys, what, change, message):
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), full_tensors())
    change(ckpt)
    manifest, problems = verify(ckpt)
    assert len(problems) == 1 and message in problems[0], problems
    assert main(["ckpt", "verify", str(ckpt)]) == 1
    assert "FAILED" in capsys.readouterr().err


def test_a_claimed_shape_the_stored_bytes_do_not_back_is_refused_before_allocation(tmp_path, monkeypatch):
    values = {"model/w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    ckpt = write_checkpoint(tmp_path / step_dir_name(1), {"model/w": ((3, 4), [((0, 0), (3, 4), "model/w@0,0")])},
                            values)
    edit_manifest(ckpt, lambda m: m["tensors"]["model/w"].update(shape=[60000, 60000]) or
                  m["tensors"]["model/w"]["slices"][0].update(shape=[60000, 60000]))  # 14.4 GB of float32
    assert read_manifest(ckpt).tensors["model/w"].shape == (60000, 60000)  # the manifest alone is consistent
    real_zeros, real_empty = torch.zeros, torch.empty

    def small(fn):
        def alloc(*args, **kwargs):
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            assert math.prod(shape) < 10**7, f"allocated {list(shape)} for a claim"
            return fn(*args, **kwargs)
        return alloc

    monkeypatch.setattr(torch, "zeros", small(real_zeros))
    monkeypatch.setattr(torch, "empty", small(real_empty))
    with pytest.raises(CheckpointError, match=r"is float32 \[3, 4\], the manifest says float32 \[60000, 60000\]"):
        export_model(ckpt, tmp_path / "out.safetensors")
    problems = verify(ckpt)[1]
    assert problems and "[60000, 60000]" in problems[0]


def test_one_stored_tensor_backs_one_slice(tmp_path):
    values = {"model/w": torch.arange(8, dtype=torch.float32)}
    ckpt = write_checkpoint(tmp_path / step_dir_name(1), {"model/w": ((8,), [((0,), (4,), "a"), ((4,), (4,), "b")])},
                            values)
    edit_manifest(ckpt, lambda m: m["tensors"]["model/w"]["slices"][1].update(key="a"))
    with pytest.raises(CheckpointError, match="each stored tensor backs one slice"):
        parse_manifest(json.loads((ckpt / MANIFEST).read_text()), "m")
