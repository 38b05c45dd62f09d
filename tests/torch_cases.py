"""Helpers (no tests): state-dict cases for the torch adapter tests: real DTensors, ShardedTensors, objects.

Each case is a global tensor and, per world size, a layout: plain (replicated),
a DTensor on a mesh with placements, or a row-wise ``ShardedTensor``. Local
shards are cut by torch's own ``_split_tensor`` semantics (or, for the FSDP2
pattern, by FSDP2's storage rule), independently of :mod:`xckpt.layout`.
Everything here runs inside ranks spawned by :func:`dist_utils.run_ranks`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from test_torch_layout import fsdp_rows, torch_indices

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64


@dataclass(frozen=True)
class D:
    """A DTensor layout: mesh shape, placements ("S0", "R", "SS0/2"), mesh ranks, names."""

    mesh: tuple[int, ...]
    placements: str
    ranks: tuple | None = None
    names: tuple[str, ...] | None = None
    fsdp: bool = False


P = "plain"
ST = "sharded_tensor"


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    dtype: torch.dtype
    layouts: dict = field(default_factory=dict)  # world size -> P | ST | D


CASES: dict[str, Case] = {
    "even": Case((8, 6), F32, {1: P, 2: D((2,), "S0"), 4: D((2, 2), "S0,S1")}),
    "uneven": Case((5, 3), F32, {1: D((1,), "S0"), 2: D((2,), "S1"), 4: D((4,), "S0")}),
    "empty_tail": Case((3, 5), F32, {1: P, 2: D((2,), "S0"), 4: D((2, 2), "S0,S0")}),
    "nested": Case((10, 4), F32, {1: P, 2: D((2,), "R"), 4: D((2, 2), "S0,S0")}),
    "replicate_axis": Case((6, 7), BF16, {1: P, 2: D((2,), "S0"), 4: D((2, 2), "R,S1")}),
    "fsdp_tp": Case((10, 4), F32, {1: P, 2: D((2,), "SS0/2"), 4: D((2, 2), "SS0/2,S0", fsdp=True)}),
    "fsdp_tp_odd": Case((7, 3), F32, {1: P, 2: D((1, 2), "SS0/2,S0", fsdp=True), 4: D((2, 2), "SS0/2,S0", fsdp=True)}),
    "strided_last": Case((8, 3), I64, {1: P, 2: D((2,), "S1"), 4: D((2, 2), "S0,SS0/2")}),
    "dense": Case((6, 5), BF16, {1: P, 2: D((2,), "S0", ranks=(1, 0)), 4: D((2, 2), "R,S0", names=("dp", "tp"))}),
    "experts": Case(
        (4, 6, 5),
        BF16,
        {1: P, 2: D((2,), "S1", ranks=(1, 0)), 4: D((2, 2), "S0,S1", ranks=((0, 2), (1, 3)), names=("ep", "tp"))},
    ),
    "big": Case((600, 256), F32, {1: P, 2: D((2,), "S0"), 4: D((4,), "S1")}),
    "table": Case((7, 4), F32, {1: P, 2: ST, 4: ST}),
    "ids": Case((3,), I64, {1: P, 2: P, 4: P}),
    "scalar": Case((), F32, {1: P, 2: P, 4: P}),
    "zero": Case((0, 4), F32, {1: P, 2: D((2,), "S0"), 4: P}),
}


def full_tensor(name: str, case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if case.dtype == I64:
        return torch.randint(-(2**62), 2**62, case.shape, generator=g, dtype=I64)
    return torch.randn(case.shape, generator=g).to(case.dtype)


def torch_placements(spec: str) -> list:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out = []
    for s in spec.split(","):
        if s == "R":
            out.append(Replicate())
        elif s.startswith("SS"):
            d, sf = s[2:].split("/")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(s[1:])))
    return out


_MESHES: dict = {}


def get_mesh(lay: D):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = lay.ranks if lay.ranks is not None else np.arange(int(np.prod(lay.mesh))).reshape(lay.mesh).tolist()
    key = (str(ranks), lay.names)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.tensor(ranks).reshape(lay.mesh), mesh_dim_names=lay.names)
    return _MESHES[key]


def local_index(lay: D, shape: tuple[int, ...], coord: tuple[int, ...]) -> list[list[int]]:
    """Per-dim global indices a coordinate holds: torch semantics, or FSDP2 storage."""
    if lay.fsdp:
        dp, tp = lay.mesh
        idx = [list(range(n)) for n in shape]
        idx[0] = fsdp_rows(shape[0], dp, tp, coord[0], coord[1])
        return idx
    return torch_indices(shape, lay.mesh, coord, torch_placements(lay.placements))


def build(name: str, case: Case, world: int, rank: int, fill: float | None = None):
    """The value this rank holds for ``name`` at ``world`` (data, or ``fill`` everywhere)."""
    full = full_tensor(name, case)
    if fill is not None:
        full = torch.full_like(full, int(fill) if case.dtype == I64 else fill)
    lay = case.layouts[world]
    if lay == P:
        return full.clone()
    if lay == ST:
        return sharded_rows(full, world, rank)
    from torch.distributed.tensor import DTensor

    mesh = get_mesh(lay)
    coord = tuple(mesh.get_coordinate())
    idx = local_index(lay, case.shape, coord)
    local = full[np.ix_(*idx)].clone() if all(idx) else torch.empty([len(i) for i in idx], dtype=case.dtype)
    return DTensor.from_local(
        local, mesh, torch_placements(lay.placements), run_check=False, shape=full.shape, stride=full.stride()
    )


def sharded_rows(full: torch.Tensor, world: int, rank: int):
    """A row-wise ShardedTensor as torchrec builds it (ceil split, empty shards left out)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    rows = full.shape[0]
    cs = -(-rows // world)
    metas, local = [], []
    for r in range(world):
        start, stop = min(rows, cs * r), min(rows, cs * (r + 1))
        if stop <= start:
            continue
        md = ShardMetadata([start] + [0] * (full.ndim - 1), [stop - start, *full.shape[1:]], f"rank:{r}/cpu")
        metas.append(md)
        if r == rank:
            local.append(Shard(full[start:stop].clone(), md))
    gmd = ShardedTensorMetadata(metas, full.shape, TensorProperties.create_from_tensor(full))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, gmd)


def expected_local(name: str, case: Case, world: int, rank: int):
    return build(name, case, world, rank)


def local_parts(v) -> list[torch.Tensor]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return [v.to_local()]
    if isinstance(v, ShardedTensor):
        return [s.tensor for s in v.local_shards()]
    return [v]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bit equality (bf16 as int16)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def compare(got, want) -> str | None:
    """None when every element of every local part is bit-equal; else a description."""
    g, w = local_parts(got), local_parts(want)
    if len(g) != len(w):
        return f"{len(g)} local parts, expected {len(w)}"
    for a, b in zip(g, w):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"local part {tuple(a.shape)} {a.dtype}, expected {tuple(b.shape)} {b.dtype}"
        if not torch.equal(bits(a), bits(b)):
            bad = int((bits(a) != bits(b)).sum())
            return f"{bad} of {a.numel()} elements differ"
    return None


def state_dict(world: int, rank: int, fill: float | None = None) -> dict:
    """The full test state dict: every case nested under "model", plus optimizer-like state."""
    from xckpt.torch import PerRank

    model = {n: build(n, c, world, rank, fill) for n, c in CASES.items()}
    ids = CASES["ids"]
    sd = {
        "model": model,
        "optim": {"state": {0: {"m": build("ids", ids, world, rank, fill), "step": None if fill is not None else 3}}},
        "step": None if fill is not None else 7,
        "cfg": None if fill is not None else {"lr": 0.1, "names": ["a", "b"], 3: (1, 2)},
        "blob": None if fill is not None else bytes(range(256)) * 20,
        "loader": PerRank(all_ranks=True) if fill is not None else PerRank({"rank": rank}),
    }
    return sd
