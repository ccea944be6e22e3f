"""Core value types: Box (Definition 3.1), Grid and its overlay (Section 5.3)."""
import itertools

import pytest

from eins.ir.types import Box, Grid, split_even


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
