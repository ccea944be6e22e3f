"""Core value types: Box (Definition 3.1), Grid and its overlay (Section 5.3)."""
import itertools
import random

import numpy as np
import pytest

from eins.ir.types import Box, Grid, split_even, tiling_error


def test_box_shape_size_contains_intersect():
    b = Box((0, 2), (4, 6))
    assert b.shape == (4, 4) and b.size == 16
    assert b.contains(Box((1, 3), (2, 6))) and not b.contains(Box((1, 3), (2, 7)))
    assert b.intersect(Box((3, 5), (9, 9))) == Box((3, 5), (4, 6))
    assert b.intersect(Box((4, 0), (5, 9))) is None
    with pytest.raises(ValueError, match="malformed box"):
        Box((2,), (1,))


def test_overlay_cells_tile_and_every_block_is_a_union_of_cells():
    a = Grid(((0, 4, 8), (0, 8)))
    b = Grid(((0, 2, 8), (0, 3, 8)))
    g = a.overlay(b)
    assert g.cuts == ((0, 2, 4, 8), (0, 3, 8))
    assert repr(g) == "Grid(3 x 2)"   # cells per dimension
    cells = g.boxes()
    assert sum(c.size for c in cells) == 64
    for block in a.boxes() + b.boxes():
        inside = g.cells_within(block)
        assert inside == [i for i, c in enumerate(cells) if block.contains(c)]
        assert sum(cells[i].size for i in inside) == block.size


def test_cells_within_matches_a_scan_on_random_grids():
    cuts = ((0, 1, 5, 6), (0, 2, 3), (0, 4, 7, 9))
    g = Grid(cuts)
    cells = g.boxes()
    for lo_hi in itertools.product(*[list(itertools.combinations(c, 2)) for c in cuts]):
        box = Box(tuple(l for l, _ in lo_hi), tuple(h for _, h in lo_hi))
        assert g.cells_within(box) == [i for i, c in enumerate(cells) if box.contains(c)]


def test_cells_within_rejects_a_box_off_the_cuts():
    with pytest.raises(ValueError, match="does not align"):
        Grid(((0, 4, 8),)).cells_within(Box((1,), (4,)))


def test_split_even():
    assert split_even(10, 3) == ((0, 4), (4, 7), (7, 10))
    assert split_even(2, 4) == ((0, 1), (1, 2), (2, 2), (2, 2))


def _brute_tiling(boxes, shape):
    """Every index of ``shape`` counted over the boxes: one each means they tile it."""
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if not Box.full(shape).contains(b):
            return False
        count[tuple(slice(l, h) for l, h in zip(b.lo, b.hi))] += 1
    return bool((count == 1).all())


def test_tiling_error_matches_counting_every_index():
    rng = random.Random(7)
    seen = set()
    for _ in range(3000):
        rank = rng.choice([1, 2, 3, 12])   # 12: mostly dims of one element (broadcasts)
        shape = tuple(rng.choice([1, 1, 1, 2, 3]) if rank > 3 else rng.randint(1, 5)
                      for _ in range(rank))
        cuts = [sorted({0, s, *rng.sample(range(s + 1), min(2, s))}) for s in shape]
        boxes = [Box(tuple(c[i] for c, i in zip(cuts, at)),
                     tuple(c[i + 1] for c, i in zip(cuts, at)))
                 for at in itertools.product(*[range(len(c) - 1) for c in cuts])]
        if rng.random() < 0.5:   # one box replaced by another of any place and size
            boxes.pop(rng.randrange(len(boxes)))
            lo = tuple(rng.randrange(s) for s in shape)
            boxes.append(Box(lo, tuple(rng.randint(a + 1, s) for a, s in zip(lo, shape))))
        if rng.random() < 0.2:   # an empty block overlaps nothing
            boxes.append(Box((0,) * rank, (0,) * rank))
        rng.shuffle(boxes)
        err = tiling_error(boxes, Box.full(shape))
        assert (err is None) == _brute_tiling(boxes, shape), (boxes, shape, err)
        seen.add("ok" if err is None else "overlap" if "overlap" in err else "size")
    assert seen == {"ok", "overlap", "size"}


@pytest.mark.parametrize("rows", [1, 300])
def test_tiling_error_on_many_blocks_names_the_overlapping_pair(rows):
    """1,024 blocks in one row (counted on the grid), or 300 rows each cut at its own column
    (too many grid cells to count: tested pairwise): a tiling passes; the last block's
    left neighbour one column wider and it one column shorter (the sizes still adding up)
    names the two blocks that overlap."""
    if rows == 1:
        width = 2048
        boxes = [Box((0, i), (1, i + 2)) for i in range(0, width, 2)]
    else:
        width = 600
        boxes = [b for r in range(rows) for c in [1 + r % (width - 1)]
                 for b in (Box((r, 0), (r + 1, c)), Box((r, c), (r + 1, width)))]
    whole = Box((0, 0), (rows, width))
    assert tiling_error(boxes, whole) is None
    a, b = boxes[-2], boxes[-1]
    wider = Box(a.lo, (a.hi[0], a.hi[1] + 1))
    shorter = Box(b.lo, (b.hi[0], b.hi[1] - 1))
    broken = boxes[:-2] + [wider, shorter]
    assert tiling_error(broken, whole) == f"blocks {wider} and {shorter} overlap"


def test_cells_within_a_grid_with_an_empty_dimension():
    """A dimension of extent 0 has no cell: no box holds any, along the others either."""
    g = Grid(((0, 2, 4), (0,)))
    assert g.boxes() == [] and g.cells_within(Box((0, 0), (4, 0))) == []
    assert Grid(((0,), (0, 2, 4))).cells_within(Box((0, 2), (0, 4))) == []
