"""Every rank's box of a tensor on a mesh of `Shard`/`Replicate` placements, as columns.

[`MeshBoxes`][xckpt.layout.MeshBoxes] is what [`mesh_boxes`][xckpt.layout.mesh_boxes] gives for
such a mesh (each tensor dim split by one mesh axis at most, as `torch.chunk` splits it), keyed by
flattened coordinate, without a box per rank: a rank's box is built when asked for, and
`columns` gives every rank's box as arrays (`plan_load` over thousands of ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from xckpt.layout._boxes import Box, Placement, Shard, _piece, shards_distinct_dims

__all__ = ["MeshBoxes"]


class MeshBoxes(Mapping[int, tuple[Box, ...]]):
    """Flattened mesh coordinate -> its boxes (one, or none where its piece is empty).

    Equal, rank for rank, to `mesh_boxes` with coordinates flattened row-major; only for
    the placements [`fits`][xckpt.layout.MeshBoxes.fits] accepts.
    """

    def __init__(self, shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.mesh_shape = tuple(int(n) for n in mesh_shape)
        self.placements = tuple(placements)
        self._n = math.prod(self.mesh_shape)
        self._strides = tuple(math.prod(self.mesh_shape[i + 1 :]) for i in range(len(self.mesh_shape)))

    @staticmethod
    def fits(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
        """Whether the placements are `Shard` of distinct dims of `shape` and `Replicate`, one per mesh axis."""
        return shards_distinct_dims(shape, mesh_shape, placements)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._n))

    def __getitem__(self, rank: int) -> tuple[Box, ...]:
        if type(rank) is not int or not 0 <= rank < self._n:
            raise KeyError(rank)
        off, shp = [0] * len(self.shape), list(self.shape)
        for p, n, s in zip(self.placements, self.mesh_shape, self._strides):
            if type(p) is Shard:
                off[p.dim], shp[p.dim] = _piece(self.shape[p.dim], n, (rank // s) % n)
        return () if 0 in shp else (Box.trusted(tuple(off), tuple(shp)),)

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(ranks, lo, hi)`: the ranks that hold a box, ascending, and their boxes `[lo, hi)`
        (`(ranks, ndim)` int64 arrays)."""
        r = np.arange(self._n, dtype=np.int64)
        lo = np.zeros((self._n, len(self.shape)), np.int64)
        hi = np.tile(np.array(self.shape, np.int64), (self._n, 1))
        for p, n, s in zip(self.placements, self.mesh_shape, self._strides):
            if type(p) is Shard:
                length = self.shape[p.dim]
                cs = -(-length // n) if length else 0
                c = (r // s) % n
                lo[:, p.dim] = np.minimum(length, cs * c)
                hi[:, p.dim] = np.minimum(length, cs * (c + 1))
        keep = (hi > lo).all(axis=1)
        return r[keep], lo[keep], hi[keep]
