"""DTensor and ShardedTensor placements -> `xckpt.layout` boxes.

The torch counterpart of `xckpt.jax._sharding`. The box arithmetic lives
in `xckpt.layout`; this module only maps torch objects onto it:

* `torch_to_layout` turns DTensor placements into layout descriptors;
* `local_pieces` says which global box each part of a rank's local
  tensor holds, for a plain tensor, a DTensor or a legacy `ShardedTensor`,
  checking the local shard's real shape against the computed boxes;
* `placement_info` records a tensor's placement in the manifest.

Nothing here talks to other ranks.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt.errors import LayoutError, UnsupportedPlacementError, XckptError
from xckpt.manifest import PlacementInfo
from xckpt.manifest import dtype_name as manifest_dtype_name
from xckpt.torch._dtypes import torch_dtype

__all__ = [
    "LocalBox",
    "Local",
    "is_dtensor",
    "is_sharded_tensor",
    "torch_to_layout",
    "pieces_from_indices",
    "pieces_from_runs",
    "mesh_group_ranks",
    "dtensor_local",
    "sharded_tensor_local",
    "global_info",
    "local_pieces",
    "placement_info",
]


#: Whole tensors: exactly these types (DTensor and ShardedTensor subclass Tensor).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(v: Any) -> bool:
    # No DTensor can exist before its module is imported; importing it here (sympy and
    # all) cost about 7 s on the first load of plain tensors (bench/formats.py profile).
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(v, mod.DTensor)


def is_sharded_tensor(v: Any) -> bool:
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return mod is not None and isinstance(v, mod.ShardedTensor)


def torch_to_layout(placements: Sequence[Any], name: str) -> list[L.Placement]:
    """DTensor placements -> `xckpt.layout` descriptors.

    Raises:
        UnsupportedPlacementError: `Partial` (and anything unknown), naming the tensor.
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out: list[L.Placement] = []
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            out.append(L.StridedShard(int(p.dim), int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(L.Shard(int(p.dim)))
        elif isinstance(p, Replicate):
            out.append(L.Replicate())
        elif p.is_partial():
            raise UnsupportedPlacementError(
                f"tensor {name!r} has a Partial placement ({p}) on mesh dim {m}: a partial value is a "
                "summand, not a region, and cannot be saved or loaded into. Reduce it first "
                "(dtensor.redistribute(mesh, [Replicate()] * mesh.ndim)) and save the result"
            )
        else:
            raise UnsupportedPlacementError(
                f"tensor {name!r}: placement {p!r} on mesh dim {m} is not understood; xckpt "
                "supports Shard, _StridedShard and Replicate"
            )
    return out


@dataclass(frozen=True)
class LocalBox:
    """Part `slices` of local tensor `tensor` holds global box `box`."""

    box: L.Box
    tensor: Any
    slices: tuple[slice, ...]


def pieces_from_indices(idx: Sequence[Sequence[int]], tensor: Any) -> list[LocalBox]:
    """Boxes of the index sets, with their slices of the local tensor (row-major)."""
    return pieces_from_runs([L.indices_to_runs(ix) for ix in idx], tensor)


def pieces_from_runs(runs: Sequence[Sequence[tuple[int, int]]], tensor: Any) -> list[LocalBox]:
    """Boxes of per-dim sorted runs `(start, length)`, with their slices of the local tensor."""
    if any(len(r) == 0 for r in runs):
        return []
    per_dim = []
    for dim_runs in runs:
        out, pos = [], 0
        for start, n in dim_runs:
            out.append((start, n, pos))
            pos += n
        per_dim.append(out)
    return [
        LocalBox(L.Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo)), tensor,
              tuple(slice(r[2], r[2] + r[1]) for r in combo))
        for combo in itertools.product(*per_dim)
    ]


@dataclass(frozen=True)
class Local:
    """What a rank holds of one tensor.

    `pieces`: the boxes with their local tensor parts. `holders`: for
    DTensors, the ranks (of the process group) holding the same pieces
    (replicas), so one of them writes each. `layout`: "placements", "fsdp2",
    "sharded_tensor" or "replicated".
    """

    pieces: tuple[LocalBox, ...]
    holders: tuple[int, ...] | None
    layout: str
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None


def mesh_group_ranks(mesh: Any, group_rank: Any, name: str) -> np.ndarray:
    """The mesh as an array of process-group ranks."""
    m = mesh.mesh
    ranks = m.cpu().numpy() if hasattr(m, "cpu") else np.asarray(m)
    out = np.empty_like(ranks)
    for c in itertools.product(*(range(n) for n in ranks.shape)):
        gr = group_rank(int(ranks[c]))
        if gr < 0:
            raise XckptError(
                f"tensor {name!r}: its device mesh holds global rank {int(ranks[c])}, which is "
                "not in the process group passed to xckpt.torch; pass a group that contains "
                "the whole mesh"
            )
        out[c] = gr
    return out


class _MeshInfo:
    """What one load or save needs of a device mesh, computed once per mesh (`mesh.mesh`
    builds a tensor on every access: about 50 us, twice per DTensor before)."""

    __slots__ = ("shape", "names", "coord", "granks")

    def __init__(self, mesh: Any, group_rank: Any, name: str) -> None:
        self.shape = tuple(int(n) for n in mesh.shape)
        self.names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        coord = mesh.get_coordinate()
        self.coord = None if coord is None else tuple(int(c) for c in coord)
        # the group rank of every mesh coordinate (none needed where this rank is not in the mesh)
        self.granks: np.ndarray = np.zeros((0,), np.int64) if coord is None else mesh_group_ranks(mesh, group_rank, name)


def dtensor_local(dt: Any, name: str, group_rank: Any, cache: dict[Any, Any] | None = None) -> Local:
    """Boxes of a DTensor's local shard, checked against its real local shape.

    For the FSDP2 + TP pattern `(_StridedShard(d, sf), ..., Shard(d))` the
    storage rule of FSDP2 ([`xckpt.layout.fsdp_boxes_for_coordinate`][xckpt.layout.fsdp_boxes_for_coordinate]) is
    preferred when the local shape fits it; otherwise the placement semantics.
    A shape that fits neither is a [`LayoutError`][xckpt.torch._placement.LayoutError]. `cache`: facts shared
    by the calls of one load or save, or None: each mesh's (by `id(mesh)`; the state
    dict keeps its meshes alive meanwhile) and each layout's (mesh, placements, global
    and local shape: the tensors of a model share a few), so a state dict of many
    tensors works each out once.
    """
    mesh = dt.device_mesh
    info = cache.get(id(mesh)) if cache is not None else None
    if info is None:
        info = _MeshInfo(mesh, group_rank, name)
        if cache is not None:
            cache[id(mesh)] = info
    if info.coord is None:  # this rank is not in the tensor's mesh
        pl_strings = tuple(L.format_placement(p) for p in torch_to_layout(dt.placements, name))
        return Local((), None, "placements", info.shape, info.names, pl_strings)
    with torch.no_grad():  # the local tensor as is, without an autograd node (13 us -> 0.5 us)
        local = dt.to_local()
    key = (id(mesh), tuple(dt.placements), tuple(dt.shape), tuple(local.shape))
    known = cache.get(key) if cache is not None else None
    if known is None:
        known = _layout_of(dt, name, info, info.coord, key[3])
        if cache is not None:
            cache[key] = known
    kind, runs, holders, pl_strings = known
    return Local(tuple(pieces_from_runs(runs, local)), holders, kind, info.shape, info.names, pl_strings)


def _layout_of(
    dt: Any, name: str, info: _MeshInfo, coord: tuple[int, ...], lshape: tuple[int, ...]
) -> tuple[str, list[list[tuple[int, int]]], tuple[int, ...], tuple[str, ...]]:
    """`dtensor_local`'s work for one layout (this rank at mesh coordinate `coord`): which
    rule fits the local shape, the per-dim runs, the ranks holding the same pieces and the
    placements as text."""
    placements = torch_to_layout(dt.placements, name)
    mesh_shape = info.shape
    gshape = tuple(int(s) for s in dt.shape)
    pl_strings = tuple(L.format_placement(p) for p in placements)
    candidates: list[tuple[str, list[list[tuple[int, int]]]]] = []
    order = L.fsdp_order(placements)
    if order is not None:
        plain = [L.Shard(p.dim) if isinstance(p, L.StridedShard) else p for p in placements]
        candidates.append(("fsdp2", L.dim_runs(gshape, mesh_shape, coord, plain, order=order, name=name)))
    candidates.append(("placements", L.dim_runs(gshape, mesh_shape, coord, placements, name=name)))
    fit = [(k, runs) for k, runs in candidates if _runs_shape(runs) == lshape]
    if not fit:
        expect = " or ".join(f"{_runs_shape(runs)} ({k})" for k, runs in candidates)
        raise LayoutError(
            f"tensor {name!r}: the local shard at mesh coordinate {coord} has shape {lshape}, "
            f"but placements {list(pl_strings)} on mesh {mesh_shape} give {expect} for global "
            f"shape {gshape}. The DTensor's metadata does not describe its data; build it with "
            "DTensor.from_local(..., shape=, stride=) or distribute_tensor"
        )
    kind, runs = fit[0]
    granks = info.granks
    # Replicas: the coordinates that agree with ours on every non-Replicate axis.
    axes = [
        range(n) if isinstance(p, L.Replicate) else (c,) for p, n, c in zip(placements, mesh_shape, coord)
    ]
    holders = tuple(sorted({int(granks[c]) for c in itertools.product(*axes)}))
    return kind, runs, holders, pl_strings


def _runs_shape(runs: Sequence[Sequence[tuple[int, int]]]) -> tuple[int, ...]:
    return tuple(sum(n for _, n in r) for r in runs)


def sharded_tensor_local(st: Any) -> Local:
    """Boxes of a legacy ShardedTensor's local shards (from their shard metadata)."""
    pieces = []
    for sh in st.local_shards():
        md = sh.metadata
        box = L.Box(tuple(md.shard_offsets), tuple(md.shard_sizes))
        if tuple(sh.tensor.shape) != box.shape:
            raise LayoutError(
                f"ShardedTensor local shard at offsets {box.offset} has shape "
                f"{tuple(sh.tensor.shape)} but its metadata says {box.shape}"
            )
        if not box.empty:
            pieces.append(LocalBox(box, sh.tensor, tuple(slice(0, n) for n in box.shape)))
    world = len({str(m.placement) for m in st.metadata().shards_metadata})
    return Local(tuple(pieces), None, "sharded_tensor", (world,))


def global_info(v: Any, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Global shape and dtype of a tensor-like value."""
    if is_sharded_tensor(v):
        md = v.metadata()
        return tuple(int(s) for s in md.size), md.tensor_properties.dtype
    if isinstance(v, np.ndarray):
        return tuple(v.shape), torch_dtype(manifest_dtype_name(v.dtype))
    return tuple(int(s) for s in v.shape), v.dtype


def local_pieces(v: Any, name: str, group_rank: Any, cache: dict[Any, Any] | None = None) -> Local:
    """What this rank holds of tensor-like `v` (tensor, DTensor, ShardedTensor, ndarray);
    `cache`: see `dtensor_local`."""
    if is_dtensor(v):
        return dtensor_local(v, name, group_rank, cache)
    if is_sharded_tensor(v):
        return sharded_tensor_local(v)
    shape = tuple(int(s) for s in v.shape)
    box = L.Box.full(shape)
    pieces = () if box.empty else (LocalBox(box, v, tuple(slice(0, n) for n in shape)),)
    return Local(pieces, None, "replicated")


def placement_info(loc: Local) -> PlacementInfo | None:
    """The manifest's record of a tensor's placement (None for a plain tensor)."""
    if loc.layout in ("placements", "fsdp2"):
        return PlacementInfo(
            framework="torch",
            mesh_shape=loc.mesh_shape,
            axis_names=loc.axis_names,
            placements=loc.placements,
            layout=loc.layout,
        )
    if loc.layout == "sharded_tensor":
        return PlacementInfo(framework="torch", mesh_shape=loc.mesh_shape, layout="sharded_tensor")
    return None
