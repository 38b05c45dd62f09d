"""Layout arithmetic: properties over random shapes, meshes and placements."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xckpt.errors import LayoutError, UnsupportedPlacementError
from xckpt.layout import (
    Box,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    box_from_index,
    boxes_for_coordinate,
    check_coverage,
    choose_writer,
    chunk_sizes,
    format_placement,
    fsdp_boxes_for_coordinate,
    indices_to_runs,
    mesh_boxes,
    parse_placement,
    plan_reads,
)

EXAMPLES = settings(max_examples=200, deadline=None)


@st.composite
def layouts(draw, shape=None):
    """(global shape, mesh shape, placements) with every kind of placement."""
    if shape is None:
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh_ndim = draw(st.integers(1, 3))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=mesh_ndim, max_size=mesh_ndim)))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["shard", "strided", "replicate"]))
        if kind == "replicate":
            placements.append(Replicate())
        else:
            d = draw(st.integers(0, len(shape) - 1))
            if kind == "shard":
                placements.append(Shard(d))
            else:
                placements.append(StridedShard(d, draw(st.integers(1, 3))))
    return shape, mesh, tuple(placements)


def distinct_boxes(shape, mesh, placements):
    seen: dict[Box, None] = {}
    for boxes in mesh_boxes(shape, mesh, placements).values():
        for b in boxes:
            seen.setdefault(b)
    return list(seen)


@EXAMPLES
@given(layouts())
def test_boxes_tile_the_tensor_exactly(layout):
    shape, mesh, placements = layout
    check_coverage(shape, distinct_boxes(shape, mesh, placements))


@EXAMPLES
@given(layouts())
def test_coordinates_hold_disjoint_or_identical_index_sets(layout):
    shape, mesh, placements = layout
    sets = {}
    for coord, boxes in mesh_boxes(shape, mesh, placements).items():
        cells = set()
        for b in boxes:
            cells.update(itertools.product(*(range(o, o + s) for o, s in zip(b.offset, b.shape))))
        sets[coord] = frozenset(cells)
    for a, b in itertools.combinations(sets.values(), 2):
        assert a == b or not (a & b)


@EXAMPLES
@given(st.data())
def test_any_saved_layout_reads_into_any_target_layout(data):
    saved = data.draw(layouts())
    shape = saved[0]
    target = data.draw(layouts(shape=shape))
    rng = np.random.default_rng(0)
    full = rng.integers(0, 1 << 30, size=shape, dtype=np.int64)
    chunks = distinct_boxes(*saved)
    stored = [full[c.slices()] for c in chunks]
    for coord, boxes in mesh_boxes(*target).items():
        for box in boxes:
            out = np.full(box.shape, -1, dtype=np.int64)
            reqs = plan_reads(chunks, box)
            for r in reqs:
                out[r.target_slices] = stored[r.chunk][r.chunk_slices]
            np.testing.assert_array_equal(out, full[box.slices()], err_msg=f"coord {coord} box {box}")
            assert sum(r.box.volume for r in reqs) == box.volume  # nothing read twice


@EXAMPLES
@given(st.integers(0, 50), st.integers(1, 9))
def test_chunk_sizes_follow_torch_chunk(length, n):
    pieces = chunk_sizes(length, n)
    cs = -(-length // n) if length else 0
    assert sum(s for _, s in pieces) == length
    assert all(0 <= s <= cs for _, s in pieces)
    pos = 0
    for start, size in pieces:
        if size:
            assert start == pos
        pos += size
    sizes = [s for _, s in pieces]
    assert sizes == sorted(sizes, reverse=True)


@EXAMPLES
@given(layouts())
def test_dropping_a_box_is_a_gap_and_doubling_one_is_an_overlap(layout):
    shape, mesh, placements = layout
    boxes = distinct_boxes(shape, mesh, placements)
    if not boxes:
        return
    with pytest.raises(LayoutError, match="gaps"):
        check_coverage(shape, boxes[1:])
    with pytest.raises(LayoutError, match="overlap"):
        check_coverage(shape, boxes + [boxes[0]])


@EXAMPLES
@given(st.text(min_size=1, max_size=20), st.integers(0, 5), st.lists(st.integers(0, 15), min_size=1, max_size=8))
def test_choose_writer_is_a_deterministic_holder(name, index, holders):
    w = choose_writer(name, index, holders)
    assert w in holders
    assert w == choose_writer(name, index, list(reversed(holders)))


def test_choose_writer_spreads_replicated_tensors_over_ranks():
    writers = {choose_writer(f"layer{i}.norm", 0, [0, 1, 2, 3]) for i in range(64)}
    assert writers == {0, 1, 2, 3}


# -- worked examples from REFERENCE.md section 1 ------------------------------


def rows(boxes):
    return [list(range(b.offset[0], b.end[0])) for b in boxes]


def test_nested_shards_on_one_dim_10x4():
    got = mesh_boxes((10, 4), (2, 2), (Shard(0), Shard(0)))
    assert [b.offset[0] for (bs) in got.values() for b in bs] == [0, 3, 5, 8]
    assert [b.shape[0] for bs in got.values() for b in bs] == [3, 2, 3, 2]


def test_uneven_shard_leaves_empty_trailing_ranks():
    got = mesh_boxes((5,), (4,), (Shard(0),))
    assert [len(v) for v in got.values()] == [1, 1, 1, 0]
    assert [b.shape for v in got.values() for b in v] == [(2,), (2,), (1,)]


def test_fsdp_tp_strided_even():
    got = mesh_boxes((8, 4), (2, 2), (StridedShard(0, 2), Shard(0)))
    assert {c: rows(b) for c, b in got.items()} == {
        (0, 0): [[0, 1]],
        (0, 1): [[4, 5]],
        (1, 0): [[2, 3]],
        (1, 1): [[6, 7]],
    }


def test_strided_last_gives_several_boxes():
    got = mesh_boxes((8, 4), (2, 2), (Shard(0), StridedShard(0, 2)))
    assert rows(got[(0, 0)]) == [[0], [2]]
    assert rows(got[(1, 1)]) == [[5], [7]]


def test_lone_strided_shard_on_1d_mesh():
    got = mesh_boxes((8,), (2,), (StridedShard(0, 2),))
    assert rows(got[(0,)]) == [[0, 1], [4, 5]]
    assert rows(got[(1,)]) == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    "length,expect",
    [
        # REFERENCE.md section 7: chunk(chunk(range(L), tp)[t], dp)[d]
        (13, {(2, 0): [6], (2, 1): [11, 12], (0, 0): [0, 1, 2], (0, 1): [7, 8]}),
        (7, {(2, 0): [], (2, 1): [6], (0, 0): [0, 1], (0, 1): [4]}),
    ],
)
def test_fsdp2_storage_rule_differs_from_placement_semantics(length, expect):
    placements = (StridedShard(0, 2), Shard(0))
    for coord, want in expect.items():
        got = fsdp_boxes_for_coordinate((length, 4), (3, 2), coord, placements)
        assert [i for r in rows(got) for i in r] == want
    sem = boxes_for_coordinate((13, 4), (3, 2), (2, 0), placements)
    assert rows(sem) == [[6], [11]]  # torch's placement semantics: not one box


def test_fsdp_rule_absent_without_the_pattern():
    assert fsdp_boxes_for_coordinate((8,), (2,), (0,), (Shard(0),)) is None


def test_partial_is_refused_naming_the_tensor():
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'w'.*Partial.*Reduce it first"):
        boxes_for_coordinate((4,), (2,), (0,), (Partial(),), name="w")


def test_placement_naming_a_missing_dim_is_refused():
    with pytest.raises(UnsupportedPlacementError, match=r"names dim 2 but the tensor has 1 dims"):
        boxes_for_coordinate((4,), (2,), (0,), (Shard(2),), name="w")


@pytest.mark.parametrize(
    "p", [Shard(1), StridedShard(0, 3), Replicate(), Partial("sum")], ids=str
)
def test_placement_strings_round_trip(p):
    assert parse_placement(format_placement(p)) == p


def test_unknown_placement_string():
    with pytest.raises(UnsupportedPlacementError, match="cannot parse placement"):
        parse_placement("Sharded(0)")


def test_plan_reads_matches_dcp_worked_example():
    saved = [Box((0, 0), (3, 4)), Box((3, 0), (2, 4)), Box((5, 0), (3, 4)), Box((8, 0), (2, 4))]
    reqs = plan_reads(saved, Box((4, 0), (4, 4)))
    assert [(r.chunk, r.chunk_slices, r.target_slices) for r in reqs] == [
        (1, (slice(1, 2), slice(0, 4)), (slice(0, 1), slice(0, 4))),
        (2, (slice(0, 3), slice(0, 4)), (slice(1, 4), slice(0, 4))),
    ]


def test_indices_to_runs():
    assert indices_to_runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 2), (9, 1)]


@pytest.mark.parametrize(
    "index,box",
    [
        (None, Box((0, 0), (6, 4))),
        ((slice(2, 5),), Box((2, 0), (3, 4))),
        ((1, slice(None)), Box((1, 0), (1, 4))),
        ((Ellipsis, slice(1, 3)), Box((0, 1), (6, 2))),
        ((-1,), Box((5, 0), (1, 4))),
    ],
)
def test_box_from_index(index, box):
    assert box_from_index((6, 4), index) == box


@pytest.mark.parametrize(
    "index,msg",
    [((slice(0, 6, 2),), "unit-step"), ((7,), "out of bounds"), ((0, 0, 0), "3 entries")],
)
def test_box_from_index_errors(index, msg):
    with pytest.raises(LayoutError, match=msg):
        box_from_index((6, 4), index)


def test_box_rejects_negative_and_rank_mismatch():
    with pytest.raises(LayoutError, match="negative"):
        Box((-1,), (2,))
    with pytest.raises(LayoutError, match="different ranks"):
        Box((0,), (2, 2))


def test_coverage_errors_name_the_tensor_and_box():
    with pytest.raises(LayoutError, match=r"tensor 'w': chunk \[0:5\] lies outside the shape \(4,\)"):
        check_coverage((4,), [Box((0,), (5,))], name="w")
    with pytest.raises(LayoutError, match=r"chunks cover 2 of 4 elements"):
        check_coverage((4,), [Box((0,), (2,))], name="w")
    with pytest.raises(LayoutError, match="is empty"):
        check_coverage((4,), [Box((0,), (4,)), Box((4,), (0,))], name="w")
    check_coverage((0, 3), [], name="empty")  # a zero-size tensor has zero chunks
    check_coverage((), [Box((), ())], name="scalar")


@EXAMPLES
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=3), st.sampled_from([1, 2, 4, 8]), st.integers(64, 1 << 22))
def test_inner_chunks_respect_the_target_and_waste_little(shape, itemsize, target):
    """zarr pads edge chunks to full size: pieces are equal, so padding stays under one piece per dim."""
    from xckpt.native._zarr import inner_chunk_shape

    grid = inner_chunk_shape(shape, itemsize, target)
    assert len(grid) == len(shape) and all(1 <= g <= s for g, s in zip(grid, shape))
    assert itemsize * np.prod(grid, dtype=np.int64) <= target
    for g, s in zip(grid, shape):
        pieces = -(-s // g)
        assert pieces * g - s < pieces  # less than one element of padding per piece


def test_plan_reads_exact_chunk_by_lookup():
    """A box equal to one saved chunk is found by `BoxIndex.exact`, with the same read as a scan."""
    from xckpt.layout._index import BoxIndex

    boxes = [Box((0, 0), (3, 4)), Box((3, 0), (5, 4)), Box((8, 0), (1, 4))]
    index = BoxIndex(boxes)
    assert index.exact(Box((3, 0), (5, 4))) == 1
    assert index.exact(Box((3, 0), (4, 4))) is None  # inside a chunk, not equal: the lookup answers
    for target in [Box((3, 0), (5, 4)), Box((2, 1), (4, 2)), Box((0, 0), (9, 4))]:
        assert plan_reads(index, target) == plan_reads(boxes, target)
