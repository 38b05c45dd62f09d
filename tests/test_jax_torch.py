"""Across frameworks: DTensor checkpoints saved by 2 and 4 gloo ranks load into
JAX on meshes of 1, 2, 4 and 8 devices; a JAX checkpoint loads into PyTorch."""

from __future__ import annotations

import functools
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from dist_utils import run_ranks

import xckpt
from xckpt.errors import UnsupportedPlacementError

# jax is imported inside the functions that use it: the spawned torch ranks import
# this module to find their function and need neither jax nor its start-up time.

try:
    import xckpt.torch  # noqa: F401

    _TORCH_ERR = None
except ImportError as e:  # torch or the adapter missing: say so, never pass silently
    _TORCH_ERR = f"xckpt.torch cannot be imported: {e}"

pytestmark = pytest.mark.skipif(_TORCH_ERR is not None, reason=_TORCH_ERR or "")

# name -> (shape, dtype, placements); meshes: 2 ranks (2,) "tp"; 4 ranks (2, 2) ("dp", "tp").
TENSORS: dict[int, dict[str, tuple[tuple[int, ...], str, tuple[str, ...]]]] = {
    2: {
        "shard0": ((16, 8), "float32", ("S0",)),
        "shard1": ((8, 16), "float32", ("S1",)),
        "uneven": ((7, 8), "float32", ("S0",)),
        "replicated": ((8, 8), "float32", ("R",)),
        "bf16": ((16, 8), "bfloat16", ("S0",)),
        "f8e4m3": ((16, 8), "float8_e4m3fn", ("S1",)),
        "f8e5m2": ((16, 8), "float8_e5m2", ("S0",)),
        "strided": ((16, 8), "float32", ("SS0/2",)),
        "plain": ((4, 8), "float32", ()),
    },
    4: {
        "two_axes": ((16, 8), "float32", ("S0", "S0")),
        "two_axes_uneven": ((10, 8), "float32", ("S0", "S0")),
        "empty_shard": ((3, 8), "float32", ("S0", "S0")),  # rows {0}, {1}, {2}, {}: rank 3 holds none
        "two_dims": ((8, 16), "float32", ("S0", "S1")),
        "fsdp": ((16, 8), "float32", ("SS0/2", "S0")),
        "fsdp_uneven": ((10, 8), "float32", ("SS0/2", "S0")),
        "strided_last": ((16, 8), "bfloat16", ("S0", "SS0/2")),
        "rep_shard": ((8, 16), "bfloat16", ("R", "S1")),
    },
}


def expected(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Deterministic contents; float8/bf16 from random bits so every pattern is hit."""
    seed = sum(map(ord, name))
    dt = xckpt.manifest.numpy_dtype(dtype)
    if dtype.startswith("float8") or dtype == "bfloat16":
        bits = np.random.default_rng(seed).integers(0, 1 << (8 * dt.itemsize), size=shape)
        return bits.astype(f"u{dt.itemsize}").view(dt)
    return np.random.default_rng(seed).standard_normal(shape).astype(dt)


def _torch_placements(codes: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for c in codes:
        if c == "R":
            out.append(Replicate())
        elif c.startswith("SS"):
            d, sf = c[2:].split("/")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(c[1:])))
    return out


def _to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype.itemsize and a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        int_t = {1: torch.uint8, 2: torch.int16}[a.dtype.itemsize]
        view = a.view(np.uint8 if a.dtype.itemsize == 1 else np.int16)
        return torch.from_numpy(view.copy()).view(int_t).view(getattr(torch, a.dtype.name))
    return torch.from_numpy(a.copy())


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        name = str(t.dtype).split(".")[1]
        raw = t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy()
        return raw.view(getattr(ml_dtypes, name))
    return t.numpy()


def _torch_ranks(rank: int, world: int, path: str, jax_path: str) -> dict[str, Any]:
    """Save the DTensors of TENSORS[world]; with 2 ranks also load the JAX checkpoint."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (2,) if world == 2 else (2, 2),
                            mesh_dim_names=("tp",) if world == 2 else ("dp", "tp"))
    sd: dict[str, Any] = {}
    for name, (shape, dtype, codes) in TENSORS[world].items():
        full = _to_torch(expected(name, shape, dtype))
        sd[name] = full if not codes else distribute_tensor(full, mesh, _torch_placements(codes), src_data_rank=None)
    xt.save(sd, path)
    result: dict[str, Any] = {"saved": sorted(sd)}
    if world == 2:
        # JAX -> torch: a DTensor target (Shard(0)) and a plain tensor target.
        want = np.load(os.path.join(jax_path, "..", "expected.npz"))
        tgt = {
            "params": {
                "w": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)], src_data_rank=None),
                "b": torch.zeros(8, 4, dtype=torch.bfloat16),
            },
            "step": 0,
        }
        xt.load(jax_path, tgt)
        local = tgt["params"]["w"].to_local()
        rows = 8 * rank
        ok_w = np.array_equal(local.numpy(), want["w"][rows:rows + 8])
        ok_b = np.array_equal(_to_numpy(tgt["params"]["b"]).view(np.uint16), want["b"])
        result.update(ok_w=bool(ok_w), ok_b=bool(ok_b), step=tgt["step"])
    return result


@functools.cache
def saved(world: int, root: str) -> str:
    path = os.path.join(root, f"torch{world}")
    jax_path = os.path.join(root, "jax", "ck")
    if world == 2:
        _save_jax(jax_path)
    results = run_ranks(_torch_ranks, world, path, jax_path, timeout=180)
    if world == 2:
        for r in results:
            if not (r["ok_w"] and r["ok_b"] and r["step"] == 5):
                raise AssertionError(f"JAX checkpoint loaded into torch differs: {results}")
    return path


def _save_jax(path: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7
    b = np.random.default_rng(9).integers(0, 1 << 16, size=(8, 4)).astype(np.uint16)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    tree = {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("b", "a"))),
            "b": jax.device_put(b.view(jnp.bfloat16), NamedSharding(mesh, P(None, "b"))),
        },
        "step": 5,
    }
    xj.save(tree, path)
    np.savez(os.path.join(path, "..", "expected.npz"), w=w, b=b)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("jax-torch"))


def target_mesh(key: str) -> Any:
    import jax
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    if key == "2x4":
        return Mesh(devs.reshape(2, 4), ("x", "y"))
    n = int(key)
    return Mesh(devs[:n], ("x",))


def spec_for(kind: str, mesh: Any, shape: tuple[int, ...]) -> Any:
    """The PartitionSpec of ``kind`` on ``mesh``, or None when it does not divide ``shape``."""
    from jax.sharding import PartitionSpec as P

    names = mesh.axis_names
    size = dict(zip(names, mesh.devices.shape))
    if kind == "replicated":
        entries: list[Any] = []
    elif kind == "dim0":
        entries = [names if len(names) > 1 else names[0]]
    elif kind == "dim1":
        entries = [None, names if len(names) > 1 else names[0]]
    else:  # "both": first axis on dim 0, last on dim 1 (one axis: dim 1 only)
        entries = [names[0], names[-1]] if len(names) > 1 else [None, names[0]]
    for d, e in enumerate(entries):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        if shape[d] % int(np.prod([size[a] for a in axes] or [1])):
            return None
    return P(*entries)


def same_bits(a: Any, b: np.ndarray) -> bool:
    a = np.asarray(a)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("kind", ["replicated", "dim0", "dim1", "both"])
@pytest.mark.parametrize("mesh_key", ["1", "2", "4", "8", "2x4"])
@pytest.mark.parametrize("world", [2, 4])
def test_torch_checkpoint_loads_into_jax(root: str, world: int, mesh_key: str, kind: str) -> None:
    from jax.sharding import NamedSharding

    import xckpt.jax as xj

    path = saved(world, root)
    mesh = target_mesh(mesh_key)
    target, want = {}, {}
    for name, (shape, dtype, _) in TENSORS[world].items():
        spec = spec_for(kind, mesh, shape)
        if spec is None:
            continue  # indivisible on this mesh (JAX has no uneven shards); covered by other kinds
        target[name] = NamedSharding(mesh, spec)
        want[name] = expected(name, shape, dtype)
    assert target, "every tensor was skipped"
    out = xj.load(path, target)
    for name, arr in out.items():
        assert arr.sharding == target[name]
        assert same_bits(arr, want[name]), name
        for shard in arr.addressable_shards:
            assert same_bits(shard.data, want[name][shard.index]), (name, shard.index)


SHARDING_FOR = {
    # name: (world, target mesh, expected PartitionSpec entries, or None when none exists)
    "shard0": (2, "2", ("x", None)),
    "shard1": (2, "2", (None, "x")),
    "replicated": (2, "2", (None, None)),
    "uneven": (2, "2", None),
    "strided": (2, "2", None),
    "plain": (2, "2", ()),
    "two_axes": (4, "2x2", (("dp", "tp"), None)),
    "two_dims": (4, "2x2", ("dp", "tp")),
    "fsdp": (4, "2x2", (("tp", "dp"), None)),
    "fsdp_uneven": (4, "2x2", None),
    "empty_shard": (4, "2x2", None),
    "strided_last": (4, "2x2", None),
    "rep_shard": (4, "2x2", (None, "tp")),
}


@pytest.mark.parametrize("name", list(SHARDING_FOR))
def test_sharding_for_torch_placement(root: str, name: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    world, mesh_key, spec = SHARDING_FOR[name]
    path = saved(world, root)
    devs = np.array(jax.devices())
    mesh = Mesh(devs[:2], ("x",)) if mesh_key == "2" else Mesh(devs[:4].reshape(2, 2), ("dp", "tp"))
    entry = xckpt.open(path).info(name)
    shape, dtype, _ = TENSORS[world][name]
    if spec is None:
        with pytest.raises(UnsupportedPlacementError, match=rf"tensor {name!r} saved by torch.*replicated"):
            xj.sharding_for(entry, mesh)
        s = NamedSharding(mesh, P())  # the fallback the message suggests still loads exactly
    else:
        s = xj.sharding_for(entry, mesh)
        assert s == NamedSharding(mesh, P(*spec))
    out = xj.load(path, {name: s})[name]
    assert same_bits(out, expected(name, shape, dtype))
    if spec is not None:  # the proposal reproduces torch's boxes device for device
        boxes = sorted((c.offset, c.shape) for c in entry.chunks)
        dev = sorted({(xckpt.layout.box_from_index(shape, i).offset, xckpt.layout.box_from_index(shape, i).shape)
                      for i in s.devices_indices_map(shape).values()})
        assert dev == boxes


def test_jax_checkpoint_loads_into_torch_single_process(root: str) -> None:
    import torch

    import xckpt.torch as xt

    saved(2, root)  # also ran the 2-rank DTensor load of the JAX checkpoint
    jax_path = os.path.join(root, "jax", "ck")
    want = np.load(os.path.join(root, "jax", "expected.npz"))
    tgt = {"params": {"w": torch.zeros(16, 8), "b": torch.zeros(8, 4, dtype=torch.bfloat16)}, "step": 0}
    xt.load(jax_path, tgt)
    assert np.array_equal(tgt["params"]["w"].numpy(), want["w"])
    assert np.array_equal(_to_numpy(tgt["params"]["b"]).view(np.uint16), want["b"])
    assert tgt["step"] == 5
