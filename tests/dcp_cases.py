"""Helpers (no tests): torch DCP checkpoints saved by real gloo ranks, and their loads.

``all_body`` runs on 4 ranks (``dist_utils.run_ranks``; sub-groups stand for
smaller worlds, so one spawn serves every case). Each world size (4, and 2 on
ranks 0-1) saves the same state twice: coordinated (``coord<W>``) and rank-local
(``local<W>``, ``use_collectives=False``, plus a per-rank object ``rank_info``).
Contents are deterministic per name (:func:`expected`), so any process can
check any box. ``load_body`` runs ``xckpt.torch.load`` into DTensors at another
world size and returns, per checkpoint and name, whether every local element
matched.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np


# name -> (shape, dtype, kind). kind: "S0" (1-D mesh, Shard(0)), "R" (1-D mesh, Replicate),
# "S0,S1" / "R,S0" (2-D mesh (2, W // 2)), None (plain tensor), "CL" (plain, channels_last),
# "T" (plain, a transposed view).
def tensors(world: int) -> dict[str, tuple[tuple[int, ...], str, str | None]]:
    return {
        "model.uneven": ((10, 6), "float32", "S0"),  # rows 3,3,3,1 at 4 ranks; 5,5 at 2
        "model.empty": ((world - 1, 8), "float32", "S0"),  # the last rank holds no row
        "model.grid": ((8, 6), "bfloat16", "S0,S1"),
        "model.rep_shard": ((6, 5), "int64", "R,S0"),
        "model.rep": ((5,), "float32", "R"),
        "model.plain": ((4, 3), "float32", None),
        "model.cl": ((2, 3, 4, 5), "float32", "CL"),
        "model.t": ((6, 4), "float32", "T"),
        "model.big": ((256, 512), "float32", "S0"),
        "optim.state.w.exp_avg": ((10, 6), "float32", "S0"),
    }


OBJECTS: dict[str, Any] = {
    "optim.state.w.step": 3,
    "optim.param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w"]}],
    "step": 7,
}


def expected(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Deterministic contents; bf16 from random bits so every pattern is hit."""
    rng = np.random.default_rng(sum(map(ord, name)))
    if dtype == "bfloat16":
        return rng.integers(0, 1 << 16, size=shape).astype(np.uint16).view(ml_dtypes.bfloat16)
    if dtype == "int64":
        return rng.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(dtype)


def to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def same_bits(a: Any, b: np.ndarray) -> bool:
    a = np.asarray(a)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
    )


def _placements(kind: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if k == "R" else Shard(int(k[1:])) for k in kind.split(",")]


def _put(sd: dict[str, Any], name: str, value: Any) -> None:
    *parents, leaf = name.split(".")
    for p in parents:
        sd = sd.setdefault(p, {})
    sd[leaf] = value


def build_state(world: int, meshes: dict[int, Any]) -> dict[str, Any]:
    """The state dict every rank saves (DTensors on the 1-D and 2-D meshes)."""
    import copy

    import torch
    from torch.distributed.tensor import distribute_tensor

    sd: dict[str, Any] = {}
    for name, (shape, dtype, kind) in tensors(world).items():
        full = to_torch(expected(name, shape, dtype))
        if kind is None:
            v = full
        elif kind == "CL":
            v = full.contiguous(memory_format=torch.channels_last)
        elif kind == "T":
            v = full.t().contiguous().t()  # strides (1, 6): a transposed view of a (4, 6) tensor
        else:
            pl = _placements(kind)
            v = distribute_tensor(full, meshes[len(pl)], pl, src_data_rank=None)
        _put(sd, name, v)
    for name, value in OBJECTS.items():
        _put(sd, name, copy.deepcopy(value))
    return sd


def _meshes(ranks: list[int]) -> dict[int, Any]:
    """A 1-D mesh over ``ranks`` and a 2-D one (2, n // 2); every rank of the world must call this."""
    from torch.distributed.device_mesh import DeviceMesh

    n = len(ranks)
    two = np.array(ranks).reshape(2, max(n // 2, 1)).tolist() if n % 2 == 0 else [ranks]
    return {1: DeviceMesh("cpu", ranks), 2: DeviceMesh("cpu", two)}


def _save(rank: int, world: int, root: str, meshes: dict[int, Any], group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(build_state(world, meshes), checkpoint_id=os.path.join(root, f"coord{world}"), process_group=group)
    sd = build_state(world, meshes)
    sd["rank_info"] = rank
    dcp.save(sd, checkpoint_id=os.path.join(root, f"local{world}"), process_group=group, use_collectives=False)


# Target placements at load time (chosen to differ from the saved ones), by tensor rank.
LOAD_KIND = {2: "S1", 1: "S0", 4: "S2"}


def all_body(rank: int, world: int, root: str) -> dict[int, Any]:
    """Runs on 4 ranks: save at 4 and (ranks 0-1) at 2; load the 4-rank saves at 2 ranks and every
    save at 3 ranks (sub-groups of the world: one spawn instead of four)."""
    import torch.distributed as dist

    if world != 4:
        raise ValueError("all_body runs on 4 ranks")
    meshes4 = _meshes([0, 1, 2, 3])
    meshes2 = _meshes([0, 1])
    mesh3 = _meshes([0, 1, 2])[1]
    g2, g3 = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    _save(rank, 4, root, meshes4, None)
    if rank < 2:
        _save(rank, 2, root, meshes2, g2)
    dist.barrier()
    four = [(k, os.path.join(root, k), 4) for k in ("coord4", "local4")]
    every = four + [(k, os.path.join(root, k), 2) for k in ("coord2", "local2")]
    out: dict[int, Any] = {}
    if rank < 2:
        out[2] = load_body(rank, meshes2[1], g2, four)
    if rank < 3:
        out[3] = load_body(rank, mesh3, g3, every)
    dist.barrier()
    return out


def load_body(rank: int, mesh: Any, group: Any, ckpts: list[tuple[str, str, int]]) -> dict[str, Any]:
    """``xckpt.torch.load`` each checkpoint into DTensors on ``mesh``; report per name."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import xckpt.torch as xt
    from xckpt.manifest import numpy_dtype

    out: dict[str, Any] = {}
    for key, path, saved_world in ckpts:
        sd: dict[str, Any] = {}
        layouts: dict[str, Any] = {}
        for name, (shape, dtype, _) in tensors(saved_world).items():
            zeros = to_torch(np.zeros(shape, dtype=numpy_dtype(dtype)))
            if name == "model.plain":
                v = zeros
                layouts[name] = None
            else:
                pl = [Shard(int(LOAD_KIND[len(shape)][1:]))]
                v = distribute_tensor(zeros, mesh, pl, src_data_rank=None)
                layouts[name] = pl
            _put(sd, name, v)
        for name in OBJECTS:
            _put(sd, name, None)
        result = xt.load(path, sd, allow_pickle=True, process_group=group)
        checks: dict[str, Any] = {}
        for name, (shape, dtype, _) in tensors(saved_world).items():
            node = _get(sd, name)
            want = expected(name, shape, dtype)
            if layouts[name] is None:
                checks[name] = same_bits(to_numpy(node), want)
                continue
            lshape, goff = compute_local_shape_and_global_offset(shape, mesh, layouts[name])
            box = tuple(slice(o, o + n) for o, n in zip(goff, lshape))
            checks[name] = same_bits(to_numpy(node.to_local()), want[box])
        objs = {n: _get(sd, n) for n in OBJECTS}
        out[key] = {"tensors": checks, "objects": objs, "skipped": result.skipped, "missing": result.missing}
    return out


def _get(sd: dict[str, Any], name: str) -> Any:
    node: Any = sd
    for p in name.split("."):
        node = node[p]
    return node
