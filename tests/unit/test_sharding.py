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
