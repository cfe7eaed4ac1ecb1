import itertools
import math

import torch

from threefold.sharding import Placement, flat_range_boxes


def test_flat_range_boxes_cover_exactly_the_range():
    for shape in [(7,), (3, 4), (2, 3, 5), (4, 1, 3)]:
        total = math.prod(shape)
        for start, end in itertools.combinations(range(total + 1), 2):
            mark = torch.zeros(shape, dtype=torch.int32)
            boxes = flat_range_boxes(shape, start, end)
            assert len(boxes) <= 2 * len(shape) - 1
            for off, shp in boxes:
                mark[tuple(slice(o, o + s) for o, s in zip(off, shp))] += 1
            expected = torch.zeros(total, dtype=torch.int32)
            expected[start:end] = 1
            assert torch.equal(mark.flatten(), expected), (shape, start, end)


def test_placement_split_pad_and_shard():
    p = Placement.whole("head.weight", (10, 4))
    part = p.padded(0, 12).split(0, 2, 3)  # vocab 10 padded to 12 over 3 ranks: rows 8..11
    assert part.offsets == (8, 0) and part.shape == (4, 4)
    assert part.boxes() == [((8, 0), (2, 4))]  # rows 10, 11 are padding
    shard = part.flat_shard(2, 10)  # elements 2..9 of the 4x4 box: row 8 cols 2-3, row 9, row 10 cols 0-1
    assert shard.numel() == 8
    assert shard.boxes() == [((8, 2), (1, 2)), ((9, 0), (1, 4))]
    assert shard.replicated("dp").replicated("dp").replicated_over == ("dp",)


def test_strided_placement_of_a_fused_tensor_round_trips_through_pieces():
    """GPT-2's c_attn: (in, 3*h) holding q | k | v; tp=2 keeps the same half of each (a strided
    placement). Each rank's local tensor, and any flat shard of it, maps back to exactly its
    elements of the global tensor."""
    from threefold.checkpoint.pieces import local_pieces, local_view

    whole = torch.arange(4 * 12, dtype=torch.float32).view(4, 12)  # h = 4: q = cols 0-3, k = 4-7, v = 8-11
    rebuilt = torch.full_like(whole, -1.0)
    for rank in range(2):
        place = Placement.whole("c_attn.weight", (4, 12)).strided(1, 3).split(1, rank, 2)
        local = torch.cat([block.chunk(2, 1)[rank] for block in whole.chunk(3, 1)], 1)
        assert place.local_shape() == (4, 6) and place.numel() == 24
        assert [b for b in place.boxes()] == [((0, 2 * rank + 4 * j), (4, 2)) for j in range(3)]
        for piece in local_pieces(place):
            assert torch.equal(local_view(local, place, piece), whole[tuple(slice(o, o + n) for o, n in
                                                                        zip(piece.offsets, piece.shape))])
            rebuilt[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))] = local_view(local, place,
                                                                                                     piece)
        for start, end in [(0, 7), (7, 17), (17, 24)]:  # ZeRO flat shards of the strided local tensor
            shard = place.flat_shard(start, end)
            flat = local.flatten()[start:end].clone()
            covered = sum(p.numel() for p in local_pieces(shard))
            assert covered == end - start
            for piece in local_pieces(shard):
                assert torch.equal(local_view(flat, shard, piece), whole[tuple(slice(o, o + n) for o, n in
                                                                              zip(piece.offsets, piece.shape))])
    assert torch.equal(rebuilt, whole)
