"""Slice arithmetic of the universal load, on synthetic placements (tp with padding, ZeRO flat shards)."""

import itertools
import math
import random

import pytest
import torch

from tests.checkpoint_layouts import local_entries, materialize, save_synthetic, tp_split, zero_shard
from threefold.checkpoint.format import CheckpointError, read_manifest
from threefold.checkpoint.pieces import intersect, local_pieces, local_view
from threefold.checkpoint.reader import load_entries
from threefold.sharding import Placement

GLOBAL = {"embed": (10, 6), "w3": (3, 5, 7), "bias": (9,), "step": ()}


def full_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) if s else torch.tensor(7.0) for n, s in GLOBAL.items()}


def random_placements(rng: random.Random, n=300):
    """tp splits (with padding) of random tensors, some of them cut again into random flat ranges."""
    for _ in range(n):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 6) for _ in range(ndim))
        dim = rng.randrange(ndim)
        parts = rng.randint(1, 4)
        padded = math.ceil(shape[dim] / parts) * parts
        place = tp_split("t", shape, dim, parts, padded)[rng.randrange(parts)]
        if rng.random() < 0.6:
            total = math.prod(place.shape)
            start = rng.randint(0, total)
            place = place.flat_shard(start, rng.randint(start, total + 3))  # may reach into flat padding
        yield place


def test_pieces_match_placement_boxes_and_views_hold_the_right_elements():
    rng = random.Random(0)
    for place in random_placements(rng):
        full = torch.arange(math.prod(place.global_shape), dtype=torch.float32).reshape(place.global_shape)
        pieces = local_pieces(place)
        assert [p.box for p in pieces] == place.boxes()
        local = materialize(full, place)
        values = []
        for piece in pieces:
            region = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))
            view = local_view(local, place, piece)
            assert torch.equal(view, full[region]), (place, piece)
            values += view.reshape(-1).tolist()
        # disjoint pieces: distinct global elements (each value is its global flat index)
        assert len(set(values)) == len(values) <= local.numel()


def test_views_are_writable_storage():
    full = torch.arange(60.0).reshape(10, 6)
    place = tp_split("e", (10, 6), 0, 4, 12)[3].flat_shard(2, 9)  # last tp part: rows 9..11, 9 real
    local = materialize(full, place)
    for piece in local_pieces(place):
        local_view(local, place, piece).fill_(-1)
    assert (local[:4] == -1).all() and (local[4:] == 0).all()  # rows 9 cols 2..5 real, then padding


def test_intersect():
    assert intersect(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert intersect(((0,), (3,)), ((3,), (2,))) is None
    assert intersect(((), ()), ((), ())) == ((), ())


def layout(kind: str):
    """Ranks (coords, placements) of a synthetic layout of the GLOBAL tensors."""
    if kind == "single":
        return [({}, {n: Placement.whole(n, s) for n, s in GLOBAL.items()})]
    if kind.startswith("tp"):  # tp x dp grid, dp replicas; ZeRO flat shards over dp when "zero" in kind
        tp, dp = int(kind[2]), int(kind[-1])
        ranks = []
        for t, d in itertools.product(range(tp), range(dp)):
            places = {"embed": tp_split("embed", (10, 6), 0, tp, math.ceil(10 / tp) * tp)[t],
                      "w3": tp_split("w3", (3, 5, 7), 2, tp, math.ceil(7 / tp) * tp)[t],
                      "bias": Placement.whole("bias", (9,)).replicated("dp", "tp"),
                      "step": Placement.whole("step", ()).replicated("dp", "tp")}
            if "zero" in kind:
                places["embed"] = zero_shard(places["embed"], dp)[d]
                places["w3"] = zero_shard(places["w3"], dp)[d]
                places["bias"] = zero_shard(Placement.whole("bias", (9,)).replicated("tp"), dp)[d]
            ranks.append(({"tp": t, "dp": d}, places))
        return ranks
    raise ValueError(kind)


LAYOUTS = ["single", "tp4-dp2", "tp4zero-dp2", "tp3zero-dp3", "tp2-dp1", "tp1zero-dp4"]


@pytest.mark.parametrize("source", LAYOUTS)
def test_any_layout_loads_any_other(tmp_path, source):
    fulls = full_tensors()
    ckpt = save_synthetic(tmp_path / "ckpts", 5, layout(source), fulls)
    manifest = read_manifest(ckpt)
    for name, full in fulls.items():
        assert manifest.tensors[name].shape == tuple(full.shape)
    writers = {f.rank for f in manifest.files.values()}
    if source == "tp4-dp2":  # replicas over dp are written by dp coordinate 0 only
        assert all(layout(source)[r][0]["dp"] == 0 for r in writers)
    for target in LAYOUTS:
        for coords, places in layout(target):
            entries = local_entries(places)
            assert load_entries(ckpt, manifest.tensors, entries) == []
            for entry in entries:
                full = fulls[entry.placement.name]
                pieces = local_pieces(entry.placement)
                for piece in pieces:
                    region = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))
                    got = local_view(entry.tensor, entry.placement, piece)
                    assert torch.equal(got, full[region]), (source, target, coords, entry.name, piece)
                filled = int((~entry.tensor.isnan()).sum())
                assert filled == sum(p.numel() for p in pieces), "padding must stay untouched"


def test_missing_and_mismatched_tensors_fail_cleanly(tmp_path):
    fulls = full_tensors()
    ckpt = save_synthetic(tmp_path / "ckpts", 1, layout("tp2-dp1"), fulls)
    manifest = read_manifest(ckpt)
    wrong = local_entries({"embed": Placement.whole("embed", (11, 6))})
    with pytest.raises(CheckpointError, match="shape"):
        load_entries(ckpt, manifest.tensors, wrong)
    absent = local_entries({"nope": Placement.whole("nope", (2,))})
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        load_entries(ckpt, manifest.tensors, absent)
    assert load_entries(ckpt, manifest.tensors, absent, missing_ok=("no",)) == ["nope"]


def test_a_broken_placement_contract_fails_the_save(tmp_path):
    """Two ranks that both claim to own the same box (replication not declared) must not produce a checkpoint."""
    places = {"bias": Placement.whole("bias", (9,))}
    with pytest.raises(CheckpointError, match="replicated"):
        save_synthetic(tmp_path / "ckpts", 1, [({"dp": 0}, places), ({"dp": 1}, places)], full_tensors())
    assert not (tmp_path / "ckpts" / "step-00000001").exists()
