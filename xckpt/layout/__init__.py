"""Pure box and placement arithmetic; no framework imports, no I/O.

A *box* is an axis-aligned region of a tensor: an `offset` and a `shape`
per dimension. Everything else in xckpt is built on three questions answered
here:

* which boxes does each mesh coordinate hold for given placements
  ([`mesh_boxes`][xckpt.layout.mesh_boxes], matching torch's DTensor semantics exactly);
* do a tensor's chunks cover it exactly ([`check_coverage`][xckpt.layout.check_coverage]);
* which parts of which saved chunks does a target box need ([`plan_reads`][xckpt.layout.plan_reads],
  found through a [`ChunkIndex`][xckpt.layout.ChunkIndex]: grid arithmetic or sorted intervals, no scan).

Placements are plain descriptors ([`Shard`][xckpt.layout.Shard], [`StridedShard`][xckpt.layout.StridedShard],
[`Replicate`][xckpt.layout.Replicate], [`Partial`][xckpt.layout.Partial]) so this package never imports torch. The
family: `_boxes` (boxes, placements, coverage) and `_index` (chunk indexes, read plans).
"""

from __future__ import annotations

from xckpt.layout._boxes import (
    Box,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    box_from_index,
    boxes_for_coordinate,
    c_strides,
    check_coverage,
    choose_writer,
    chunk_sizes,
    dim_indices,
    dim_runs,
    format_placement,
    fsdp_boxes_for_coordinate,
    fsdp_order,
    holders_by_box,
    index_sets,
    indices_to_runs,
    mesh_boxes,
    parse_placement,
    parse_placements,
)
from xckpt.layout._index import (
    BoxIndex,
    ChunkIndex,
    GridAxis,
    GridIndex,
    ReadRequest,
    covers,
    plan_reads,
)
from xckpt.layout._mesh import MeshBoxes

__all__ = [
    "c_strides",
    "Box",
    "Shard",
    "StridedShard",
    "Replicate",
    "Partial",
    "Placement",
    "ReadRequest",
    "chunk_sizes",
    "dim_indices",
    "indices_to_runs",
    "dim_runs",
    "index_sets",
    "boxes_for_coordinate",
    "mesh_boxes",
    "MeshBoxes",
    "fsdp_boxes_for_coordinate",
    "check_coverage",
    "choose_writer",
    "plan_reads",
    "ChunkIndex",
    "GridAxis",
    "GridIndex",
    "BoxIndex",
    "box_from_index",
    "parse_placement",
    "parse_placements",
    "format_placement",
    "covers",
    "holders_by_box",
    "fsdp_order",
]
