"""Shared pieces of the torch adapter: dtypes, numpy views, flattening, boxes.

Nothing here talks to other ranks. The box arithmetic itself lives in
:mod:`xckpt.layout`; this module only maps torch objects onto it:

* :func:`torch_to_layout` turns DTensor placements into layout descriptors;
* :func:`local_pieces` says which global box each part of a rank's local
  tensor holds, for a plain tensor, a DTensor or a legacy ``ShardedTensor``,
  checking the local shard's real shape against the computed boxes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt.errors import LayoutError, ObjectError, UnsupportedPlacementError, XckptError

__all__ = [
    "PerRank",
    "Piece",
    "dtype_name",
    "torch_dtype",
    "as_numpy",
    "flatten",
    "Slot",
    "torch_to_layout",
    "local_pieces",
    "is_dtensor",
    "is_sharded_tensor",
    "mesh_group_ranks",
]


# ---------------------------------------------------------------------------
# Per-rank objects


@dataclass
class PerRank:
    """Wrap a non-tensor value that differs between ranks (e.g. a data-loader state).

    On save each rank's own ``value`` is stored. On load, a ``PerRank`` placeholder
    receives ``PerRank(<this rank's saved value>)``; at another world size that is
    an error unless the placeholder is ``PerRank(all_ranks=True)``, which receives
    ``PerRank([value of rank 0, value of rank 1, ...], all_ranks=True)``.
    """

    value: Any = None
    all_ranks: bool = False


# ---------------------------------------------------------------------------
# dtypes and numpy views

_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz",
    torch.float8_e5m2fnuz: "float8_e5m2fnuz",
}
_DTYPES = {v: k for k, v in _NAMES.items()}
# dtypes numpy lacks: viewed as same-width unsigned ints, then as ml_dtypes.
_BITS = {"bfloat16": torch.uint16}
_BITS.update({n: torch.uint8 for n in _NAMES.values() if n.startswith("float8")})


def dtype_name(dtype: torch.dtype, name: str = "<tensor>") -> str:
    """The manifest dtype name of a torch dtype."""
    n = _NAMES.get(dtype)
    if n is None:
        raise ObjectError(
            f"tensor {name!r} has dtype {dtype}, which xckpt cannot store; supported: "
            f"{', '.join(_NAMES.values())}. Cast it before saving"
        )
    return n


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name."""
    return _DTYPES[name]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, bf16/float8 as ml_dtypes."""
    t = t.detach()
    if t.device.type != "cpu":
        raise XckptError(f"internal: as_numpy needs a CPU tensor, got one on {t.device}")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    n = _NAMES.get(t.dtype)
    bits = _BITS.get(n) if n is not None else None
    if bits is None:
        return t.numpy()
    from xckpt.manifest import numpy_dtype

    return t.view(bits).numpy().view(numpy_dtype(n))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Flattening nested state dicts


@dataclass
class Slot:
    """Where a flattened leaf lives in the caller's structure (to put objects back)."""

    container: Any
    key: Any


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(v, Mapping):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Slot]]:
    """Flatten nested dicts to "."-joined names (keys via ``str``).

    Dicts, lists and tuples are flattened (lists by index) only when they hold a
    tensor somewhere inside; otherwise they are one leaf (an object), like every
    other non-tensor value. The same rule applied to the caller's structure on
    load gives the same names.

    Returns:
        ``(leaves by name, slot by name)``.

    Raises:
        XckptError: two paths flatten to the same name.
    """
    leaves: dict[str, Any] = {}
    slots: dict[str, Slot] = {}

    def walk(prefix: str, container: Any, key: Any, v: Any) -> None:
        if isinstance(v, Mapping) and _holds_tensor(v):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, k, x)
            return
        if isinstance(v, (list, tuple)) and _holds_tensor(v):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}" if prefix else str(i), v, i, x)
            return
        if prefix in leaves:
            raise XckptError(
                f"two entries of the state dict flatten to the name {prefix!r} (a key that "
                "contains '.' next to a nested dict); rename one of them"
            )
        leaves[prefix] = v
        slots[prefix] = Slot(container, key)

    if not isinstance(state, Mapping):
        raise XckptError(f"state_dict must be a dict, got {type(state).__name__}")
    for k, v in state.items():
        walk(str(k), state, k, v)
    return leaves, slots


# ---------------------------------------------------------------------------
# Placements and local pieces


def is_dtensor(v: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(v, DTensor)


def is_sharded_tensor(v: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(v, ShardedTensor)


def torch_to_layout(placements: Sequence[Any], name: str) -> list[L.Placement]:
    """DTensor placements -> :mod:`xckpt.layout` descriptors.

    Raises:
        UnsupportedPlacementError: ``Partial`` (and anything unknown), naming the tensor.
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
class Piece:
    """Part ``slices`` of local tensor ``tensor`` holds global box ``box``."""

    box: L.Box
    tensor: Any
    slices: tuple[slice, ...]


def _pieces_from_indices(idx: Sequence[Sequence[int]], tensor: Any) -> list[Piece]:
    """Boxes of the index sets, with their slices of the local tensor (row-major)."""
    if any(len(i) == 0 for i in idx):
        return []
    per_dim = []
    for ix in idx:
        runs, pos = [], 0
        for start, n in L.indices_to_runs(ix):
            runs.append((start, n, pos))
            pos += n
        per_dim.append(runs)
    out = []
    for combo in itertools.product(*per_dim):
        box = L.Box(tuple(r[0] for r in combo), tuple(r[1] for r in combo))
        out.append(Piece(box, tensor, tuple(slice(r[2], r[2] + r[1]) for r in combo)))
    return out


@dataclass(frozen=True)
class Local:
    """What a rank holds of one tensor.

    ``pieces``: the boxes with their local tensor parts. ``holders``: for
    DTensors, the ranks (of the process group) holding the same pieces
    (replicas), so one of them writes each. ``layout``: "placements", "fsdp2",
    "sharded_tensor" or "replicated".
    """

    pieces: tuple[Piece, ...]
    holders: tuple[int, ...] | None
    layout: str
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None


def mesh_group_ranks(mesh: Any, group_rank: Any, name: str) -> np.ndarray:
    """The mesh as an array of process-group ranks."""
    ranks = mesh.mesh.cpu().numpy() if hasattr(mesh.mesh, "cpu") else np.asarray(mesh.mesh)
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


def dtensor_local(dt: Any, name: str, group_rank: Any) -> Local:
    """Boxes of a DTensor's local shard, checked against its real local shape.

    For the FSDP2 + TP pattern ``(_StridedShard(d, sf), ..., Shard(d))`` the
    storage rule of FSDP2 (:func:`xckpt.layout.fsdp_boxes_for_coordinate`) is
    preferred when the local shape fits it; otherwise the placement semantics.
    A shape that fits neither is a :class:`LayoutError`.
    """
    mesh = dt.device_mesh
    placements = torch_to_layout(dt.placements, name)
    mesh_shape = tuple(int(n) for n in mesh.shape)
    gshape = tuple(int(s) for s in dt.shape)
    pl_strings = tuple(L.format_placement(p) for p in placements)
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh
        return Local((), None, "placements", mesh_shape, names, pl_strings)
    coord = tuple(int(c) for c in coord)
    local = dt.to_local()
    lshape = tuple(int(s) for s in local.shape)
    candidates: list[tuple[str, list[list[int]]]] = []
    order = L.fsdp_order(placements)
    if order is not None:
        plain = [L.Shard(p.dim) if isinstance(p, L.StridedShard) else p for p in placements]
        candidates.append(
            ("fsdp2", L.dim_indices(gshape, mesh_shape, coord, plain, order=order, name=name))
        )
    candidates.append(("placements", L.dim_indices(gshape, mesh_shape, coord, placements, name=name)))
    fit = [(k, idx) for k, idx in candidates if tuple(len(i) for i in idx) == lshape]
    if not fit:
        expect = " or ".join(f"{tuple(len(i) for i in idx)} ({k})" for k, idx in candidates)
        raise LayoutError(
            f"tensor {name!r}: the local shard at mesh coordinate {coord} has shape {lshape}, "
            f"but placements {list(pl_strings)} on mesh {mesh_shape} give {expect} for global "
            f"shape {gshape}. The DTensor's metadata does not describe its data; build it with "
            "DTensor.from_local(..., shape=, stride=) or distribute_tensor"
        )
    kind, idx = fit[0]
    granks = mesh_group_ranks(mesh, group_rank, name)
    # Replicas: the coordinates that agree with ours on every non-Replicate axis.
    axes = [range(n) if isinstance(p, L.Replicate) else (c,) for p, n, c in zip(placements, mesh_shape, coord)]
    holders = tuple(sorted({int(granks[c]) for c in itertools.product(*axes)}))
    return Local(
        tuple(_pieces_from_indices(idx, local)), holders, kind, mesh_shape, names, pl_strings
    )


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
            pieces.append(Piece(box, sh.tensor, tuple(slice(0, n) for n in box.shape)))
    world = len({str(m.placement) for m in st.metadata().shards_metadata})
    return Local(tuple(pieces), None, "sharded_tensor", (world,))


def global_info(v: Any, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Global shape and dtype of a tensor-like value."""
    if is_sharded_tensor(v):
        md = v.metadata()
        return tuple(int(s) for s in md.size), md.tensor_properties.dtype
    if isinstance(v, np.ndarray):
        return tuple(v.shape), _np_torch_dtype(v, name)
    return tuple(int(s) for s in v.shape), v.dtype


def _np_torch_dtype(a: np.ndarray, name: str) -> torch.dtype:
    from xckpt.manifest import dtype_name as np_name

    return torch_dtype(np_name(a.dtype))


def local_pieces(v: Any, name: str, group_rank: Any) -> Local:
    """What this rank holds of tensor-like ``v`` (tensor, DTensor, ShardedTensor, ndarray)."""
    if is_dtensor(v):
        return dtensor_local(v, name, group_rank)
    if is_sharded_tensor(v):
        return sharded_tensor_local(v)
    shape = tuple(int(s) for s in v.shape)
    box = L.Box.full(shape)
    pieces = () if box.empty else (Piece(box, v, tuple(slice(0, n) for n in shape)),)
    return Local(pieces, None, "replicated")


def iter_tensor_names(leaves: Mapping[str, Any]) -> Iterator[str]:
    for n, v in leaves.items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            yield n


def raise_for_ranks(msgs: Sequence[str | None], error: type[Exception], what: str, fix: str) -> None:
    """Raise ``error`` naming every rank whose exchanged outcome ``msgs[r]`` is a failure.

    Used after an all-gather of outcomes, so every rank raises together and
    none is left waiting in a collective.
    """
    bad = {r: m for r, m in enumerate(msgs) if m is not None}
    if bad:
        raise error(
            f"{what} failed on ranks {sorted(bad)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
            + f". {fix}"
        )
