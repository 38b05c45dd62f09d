"""xckpt.jax: round trips on simulated 8-device CPU meshes, resharding, dtypes,
error paths, sharding_for, and the bytes a partial load really reads."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import functools  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorstore as ts  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import xckpt  # noqa: E402
import xckpt.jax as xj  # noqa: E402
import xckpt.jax._load as jax_load  # noqa: E402
import xckpt.native.writer  # noqa: E402
import xckpt.storage  # noqa: E402
from xckpt.errors import (  # noqa: E402
    CheckpointExistsError,
    CorruptChunkError,
    DtypeMismatchError,
    MissingEntryError,
    ObjectError,
    ShapeMismatchError,
    UnsupportedPlacementError,
    XckptError,
)
from xckpt.layout import Box  # noqa: E402
from xckpt.manifest import PlacementInfo  # noqa: E402

if len(jax.devices()) != 8:
    raise RuntimeError(
        f"tests/test_jax.py needs 8 CPU devices, jax has {len(jax.devices())}: the jax backend was "
        f"started before this module set XLA_FLAGS={_FLAG}; set it in tests/conftest.py"
    )

MESHES = {
    "8": ((8,), ("x",)),
    "2x4": ((2, 4), ("a", "b")),
    "4x2": ((4, 2), ("a", "b")),
}


@functools.cache
def mesh(key: str) -> jax.sharding.Mesh:
    shape, names = MESHES[key]
    return jax.make_mesh(shape, names)


def sharding(key: str, *spec: object) -> NamedSharding:
    return NamedSharding(mesh(key), P(*spec))


def data(shape: tuple[int, ...], dtype: object = np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype)


def same(a: object, b: object) -> bool:
    """Equal dtype, shape and bytes (bit-exact: NaN payloads and -0.0 included)."""
    a, b = np.array(a, order="C"), np.array(b, order="C")
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


# ---------------------------------------------------------------------------
# Round trips: saved layout x target layout

SAVED = {
    "8-dim0": ("8", ("x",)),
    "8-dim1": ("8", (None, "x")),
    "2x4-two-dims": ("2x4", ("a", "b")),
    "2x4-tuple-dim0": ("2x4", (("a", "b"),)),
    "4x2-reversed-tuple": ("4x2", (("b", "a"), None)),
    "4x2-one-axis": ("4x2", ("a",)),
    "2x4-replicated": ("2x4", ()),
}
TARGETS = {
    "same": None,
    "replicated-8": ("8", ()),
    "2x4-two-dims": ("2x4", ("a", "b")),
    "4x2-tuple-dim1": ("4x2", (None, ("b", "a"))),
    "8-dim0": ("8", ("x",)),
}
SHAPE = (16, 8)


@functools.cache
def saved_checkpoint(case: str, root: str) -> tuple[str, np.ndarray, np.ndarray]:
    mkey, spec = SAVED[case]
    s = sharding(mkey, *spec)
    w = data(SHAPE, seed=1)
    b = data(SHAPE, jnp.bfloat16, seed=2)
    path = os.path.join(root, case)
    xj.save({"params": {"w": jax.device_put(w, s), "b": jax.device_put(b, s)}}, path)
    return path, w, b


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("jax-roundtrip"))


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", list(SAVED))
def test_round_trip(root: str, case: str, target: str) -> None:
    path, w, b = saved_checkpoint(case, root)
    mkey, spec = SAVED[case] if TARGETS[target] is None else TARGETS[target]
    s = sharding(mkey, *spec)
    out = xj.load(path, {"params": {"w": s, "b": jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=s)}})
    for got, want in ((out["params"]["w"], w), (out["params"]["b"], b)):
        assert isinstance(got, jax.Array) and got.sharding == s
        assert same(got, want)
        for shard in got.addressable_shards:  # every device holds exactly its box
            assert same(shard.data, want[shard.index])


@pytest.mark.parametrize("case", list(SAVED))
def test_each_distinct_box_written_once(root: str, case: str) -> None:
    path, _, _ = saved_checkpoint(case, root)
    mkey, spec = SAVED[case]
    boxes = {xckpt.layout.box_from_index(SHAPE, i)
             for i in sharding(mkey, *spec).devices_indices_map(SHAPE).values()}
    chunks = xckpt.open(path).info("params.w").chunks
    assert sorted(c.box.offset for c in chunks) == sorted(b.offset for b in boxes)
    info = xckpt.open(path).info("params.w").placement
    assert info == PlacementInfo(
        framework="jax",
        mesh_shape=MESHES[mkey][0],
        axis_names=MESHES[mkey][1],
        partition_spec=tuple(list(spec) + [None] * (2 - len(spec))),
    )


def test_scalars_numpy_and_objects(tmp_path: object) -> None:
    path = str(tmp_path)
    s8 = sharding("8")
    tree = {
        "step": 12,
        "lr": 0.5,
        "name": "run-1",
        "flag": True,
        "blob": b"\x00\x01",
        "np_scalar": np.float32(2.5),
        "np_array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "jax_scalar": jax.device_put(jnp.float32(7.0), s8),
        "jax_scalar_1dev": jax.device_put(jnp.int32(3), SingleDeviceSharding(jax.devices()[5])),
        "layers": [jax.device_put(data((8,)), sharding("8", "x")), (np.zeros((3,), np.uint8),)],
    }
    xj.save(tree, path)
    host = xj.load(path)
    assert host["step"] == 12 and host["lr"] == 0.5 and host["name"] == "run-1"
    assert host["flag"] is True and host["blob"] == b"\x00\x01"
    assert same(host["np_scalar"], np.asarray(np.float32(2.5)))
    assert same(host["np_array"], tree["np_array"])
    assert same(host["jax_scalar"], np.asarray(np.float32(7.0)))
    assert same(host["layers.0"], np.asarray(tree["layers"][0]))
    assert same(host["layers.1.0"], np.zeros((3,), np.uint8))
    target = {
        "step": 0, "lr": 0.0, "name": "", "flag": False, "blob": b"",
        "np_scalar": np.zeros((), np.float32),
        "np_array": np.zeros((2, 3), np.int16),
        "jax_scalar": s8,
        "jax_scalar_1dev": SingleDeviceSharding(jax.devices()[2]),
        "layers": [sharding("2x4", ("a",)), (sharding("4x2"),)],
    }
    out = xj.load(path, target)
    assert jax.tree.structure(out) == jax.tree.structure(target)
    assert out["step"] == 12 and out["blob"] == b"\x00\x01" and out["flag"] is True
    assert same(out["np_array"], tree["np_array"])
    assert out["jax_scalar"].sharding == s8 and same(out["jax_scalar"], np.float32(7.0))
    assert out["jax_scalar_1dev"].devices() == {jax.devices()[2]}
    assert same(out["jax_scalar_1dev"], np.int32(3))
    assert same(out["layers"][0], np.asarray(tree["layers"][0]))
    assert same(out["layers"][1][0], np.zeros((3,), np.uint8))


def test_flat_dict_target(tmp_path: object) -> None:
    path = str(tmp_path)
    w = data((8, 8))
    xj.save({"params": {"layers": [{"kernel": jax.device_put(w, sharding("2x4", "a", "b"))}]}}, path)
    assert xckpt.open(path).names() == ["params.layers.0.kernel"]
    s = sharding("4x2", None, ("a", "b"))
    out = xj.load(path, {"params.layers.0.kernel": s})
    assert list(out) == ["params.layers.0.kernel"]
    assert out["params.layers.0.kernel"].sharding == s and same(out["params.layers.0.kernel"], w)


def test_array_leaves_and_small_host_budget(tmp_path: object) -> None:
    """A jax.Array target gives its sharding, shape and dtype; a 1-byte budget reads
    one array per batch and still fills every array."""
    path = str(tmp_path)
    a, b = data((8, 8), seed=5), data((16,), jnp.bfloat16, seed=6)
    xj.save({"a": jax.device_put(a, sharding("8")), "b": jax.device_put(b, sharding("8", "x"))}, path)
    like = {"a": jnp.zeros((8, 8), jnp.float32, device=sharding("2x4", "b", "a")),
            "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=sharding("4x2", ("a", "b")))}
    out = xj.load(path, like, host_budget=1)
    assert out["a"].sharding == like["a"].sharding and same(out["a"], a)
    assert out["b"].sharding == like["b"].sharding and same(out["b"], b)


def test_uneven_layout_saved_by_xckpt_writer_loads(tmp_path: object) -> None:
    """Chunks of any (uneven, empty-tailed) layout reassemble into any JAX sharding."""
    path = str(tmp_path)
    full = data((10, 8), seed=3)
    writers = [xckpt.Writer(path, rank=r, world_size=4, save_id="u") for r in range(4)]
    for r, (start, size) in enumerate(xckpt.layout.chunk_sizes(10, 4)):  # 3,3,3,1 rows
        writers[r].write("w", full[start:start + size], global_shape=(10, 8), offset=(start, 0))
    for wr in writers:
        wr.commit()
    for s in (sharding("8", None, "x"), sharding("2x4", "a", "b"), sharding("8")):
        out = xj.load(path, {"w": s})["w"]
        assert same(out, full)


DTYPES = ["bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32",
          "complex64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_round_trip_bit_exact(tmp_path: object, dtype: str) -> None:
    dt = xckpt.manifest.numpy_dtype(dtype)
    raw = np.random.default_rng(4).integers(0, 256, size=(8, 4 * dt.itemsize), dtype=np.uint8)
    arr = raw.view(dt) if dt != np.bool_ else raw.astype(bool)  # every bit pattern, NaNs included
    s = sharding("2x4", "a", "b")
    xj.save({"x": jax.device_put(arr, s)}, str(tmp_path))
    out = xj.load(str(tmp_path), {"x": sharding("4x2", ("b", "a"))})["x"]
    assert out.dtype == dt and same(out, arr)
    assert xckpt.open(str(tmp_path)).info("x").dtype == dtype


@pytest.mark.parametrize("dtype", ["int64", "uint64", "float64", "complex128"])
def test_64bit_dtypes_with_x64(tmp_path: object, dtype: str) -> None:
    dt = np.dtype(dtype)
    arr = np.random.default_rng(5).integers(0, 256, size=(8, 8 * dt.itemsize), dtype=np.uint8).view(dt)
    xckpt.save({"x": arr}, str(tmp_path))
    with pytest.raises(DtypeMismatchError, match=rf"tensor 'x': saved as {dtype}.*jax_enable_x64"):
        xj.load(str(tmp_path), {"x": sharding("8")})
    with jax.enable_x64(True):
        out = xj.load(str(tmp_path), {"x": sharding("8", "x")})["x"]
        assert out.dtype == dt and same(out, arr)


def test_overwrite(tmp_path: object) -> None:
    path = str(tmp_path)
    xj.save({"x": jnp.zeros((4,))}, path)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        xj.save({"x": jnp.ones((4,))}, path)
    xj.save({"x": jnp.ones((4,))}, path, overwrite=True)
    assert same(xj.load(path)["x"], np.ones((4,), np.float32))


# ---------------------------------------------------------------------------
# Error paths


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("jax-errors") / "ck")
    xj.save({"w": jax.device_put(data((8, 6)), sharding("8", "x")), "step": 3}, path)
    return path


def test_error_shape_mismatch(small_ckpt: str) -> None:
    with pytest.raises(ShapeMismatchError, match=r"checkpoint '.*ck', tensor 'w': saved with shape \(8, 6\).*\(8, 4\)"):
        xj.load(small_ckpt, {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding("8"))})


def test_error_dtype_mismatch(small_ckpt: str) -> None:
    with pytest.raises(DtypeMismatchError, match=r"tensor 'w': saved as float32.*bfloat16.*cast after loading"):
        xj.load(small_ckpt, {"w": jax.ShapeDtypeStruct((8, 6), jnp.bfloat16, sharding=sharding("8"))})


def test_error_numpy_leaf_dtype_mismatch(small_ckpt: str) -> None:
    with pytest.raises(DtypeMismatchError, match=r"tensor 'w': saved as float32.*int32"):
        xj.load(small_ckpt, {"w": np.zeros((8, 6), np.int32)})


def test_error_missing_name(small_ckpt: str) -> None:
    with pytest.raises(MissingEntryError, match=r"checkpoint '.*ck' has no tensor 'v'"):
        xj.load(small_ckpt, {"v": sharding("8")})


def test_error_missing_object(small_ckpt: str) -> None:
    with pytest.raises(MissingEntryError, match=r"has no tensor or object 'epoch'.*key paths"):
        xj.load(small_ckpt, {"epoch": 0})


def test_error_no_sharding(small_ckpt: str) -> None:
    with pytest.raises(XckptError, match=r"tensor 'w': the target ShapeDtypeStruct has no sharding"):
        xj.load(small_ckpt, {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)})


def test_error_indivisible_sharding(small_ckpt: str) -> None:
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'w': sharding .* cannot lay out shape \(8, 6\).*divide"):
        xj.load(small_ckpt, {"w": sharding("8", None, "x")})


def test_error_unsupported_leaf(tmp_path: object) -> None:
    with pytest.raises(ObjectError, match=r"leaf 'a.0' is a dict_keys"):
        xj.save({"a": [{}.keys()]}, str(tmp_path))


def test_error_bare_array(tmp_path: object) -> None:
    with pytest.raises(ObjectError, match=r"bare array.*\{'x': array\}"):
        xj.save(jnp.zeros((2,)), str(tmp_path))


def test_error_unsupported_dtype(tmp_path: object) -> None:
    with pytest.raises(ObjectError, match=r"tensor 'q' has dtype int4.*Cast it"):
        xj.save({"q": jnp.zeros((4,), jnp.int4)}, str(tmp_path))


# ---------------------------------------------------------------------------
# sharding_for


def torch_info(placements: tuple[str, ...], mesh_shape: tuple[int, ...], names: tuple[str, ...] | None,
               layout: str = "placements") -> PlacementInfo:
    return PlacementInfo(framework="torch", mesh_shape=mesh_shape, axis_names=names,
                         placements=placements, layout=layout)


SHARDING_FOR = {
    "shard0-tp": (torch_info(("Shard(0)",), (2,), ("tp",)), (8, 4), "8", {"tp": "x"}, P("x", None)),
    "shard0-positional": (torch_info(("Shard(0)",), (2,), None), (8, 4), "8", None, P("x", None)),
    "shard1": (torch_info(("Shard(1)",), (4,), None), (8, 16), "8", None, P(None, "x")),
    "replicate": (torch_info(("Replicate()",), (2,), None), (8, 4), "8", None, P(None, None)),
    "two-axes-one-dim": (torch_info(("Shard(0)", "Shard(0)"), (2, 4), ("a", "b")), (16, 3), "2x4", None,
                         P(("a", "b"), None)),
    "two-dims": (torch_info(("Shard(0)", "Shard(1)"), (2, 4), ("a", "b")), (8, 8), "2x4", None, P("a", "b")),
    "replicate-shard": (torch_info(("Replicate()", "Shard(1)"), (4, 2), ("a", "b")), (3, 8), "4x2", None,
                        P(None, "b")),
    "fsdp2-strided": (torch_info(("_StridedShard(0, sf=2)", "Shard(0)"), (4, 2), ("a", "b"), "fsdp2"), (16, 4),
                      "4x2", None, P(("b", "a"), None)),
    "renamed-axes": (torch_info(("Shard(0)", "Shard(1)"), (2, 4), ("dp", "tp")), (8, 8), "2x4", ["b", "a"],
                     P("b", "a")),
    "drop-axis": (torch_info(("Shard(0)", "Shard(1)"), (2, 4), ("dp", "tp")), (8, 8), "8", {"dp": None, "tp": "x"},
                  P(None, "x")),
    "jax-spec": (PlacementInfo(framework="jax", mesh_shape=(2, 4), axis_names=("a", "b"),
                               partition_spec=(("a", "b"), None)), (8, 8), "2x4", None, P(("a", "b"), None)),
    "jax-spec-renamed": (PlacementInfo(framework="jax", mesh_shape=(2, 4), axis_names=("dp", "tp"),
                                       partition_spec=("tp", None)), (8, 8), "4x2", {"dp": "b", "tp": "a"},
                         P("a", None)),
    "no-placement": (None, (5, 3), "8", None, P()),
    "no-shape-given": (torch_info(("Shard(1)",), (2,), None), None, "8", None, P(None, "x")),
}


@pytest.mark.parametrize("case", list(SHARDING_FOR))
def test_sharding_for(case: str) -> None:
    info, shape, mkey, axis_names, want = SHARDING_FOR[case]
    got = xj.sharding_for(info, mesh(mkey), axis_names=axis_names, shape=shape)
    assert got == NamedSharding(mesh(mkey), want)


SHARDING_FOR_ERRORS = {
    "uneven": (torch_info(("Shard(0)",), (4,), ("tp",)), (10, 4), "8", {"tp": "x"},
               r"dim 0 of size 10 does not split evenly over mesh axes \('x',\) \(8 ways\).*replicated sharding"),
    "lone-strided": (torch_info(("_StridedShard(0, sf=2)",), (2,), None), (8,), "8", None,
                     r"_StridedShard\(0, sf=2\) on mesh dim 0 is not FSDP2's.*several disjoint boxes.*replicated"),
    "strided-last": (torch_info(("Shard(0)", "_StridedShard(0, sf=2)"), (2, 4), ("a", "b")), (16,), "2x4", None,
                     r"not FSDP2's"),
    "partial": (torch_info(("Partial(sum)",), (2,), None), (4,), "8", None, r"Partial on mesh dim 0 has no sharding"),
    "unmapped-axes": (torch_info(("Shard(0)", "Shard(1)"), (2, 4), ("dp", "tp")), (8, 8), "8", None,
                      r"do not match the target mesh axes \['x'\]; pass axis_names="),
    "sharded-tensor": (PlacementInfo(framework="torch", mesh_shape=(2,), layout="sharded_tensor"), (8,), "8",
                       None, r"saved as a sharded_tensor tensor without DTensor placements"),
    "unknown-axis": (torch_info(("Shard(0)",), (2,), ("tp",)), (8,), "8", ["y"], r"must name distinct axes"),
}


@pytest.mark.parametrize("case", list(SHARDING_FOR_ERRORS))
def test_sharding_for_errors(case: str) -> None:
    info, shape, mkey, axis_names, msg = SHARDING_FOR_ERRORS[case]
    with pytest.raises(UnsupportedPlacementError, match=msg):
        xj.sharding_for(info, mesh(mkey), axis_names=axis_names, shape=shape)


def test_sharding_for_uneven_names_tensor_and_replicated_still_loads(tmp_path: object) -> None:
    path = str(tmp_path)
    full = data((10, 4))
    info = torch_info(("Shard(0)",), (4,), ("tp",))
    writers = [xckpt.Writer(path, rank=r, world_size=4, save_id="t") for r in range(4)]
    for r, (start, size) in enumerate(xckpt.layout.chunk_sizes(10, 4)):
        writers[r].write("w", full[start:start + size], global_shape=(10, 4), offset=(start, 0), placement=info)
    for wr in writers:
        wr.commit()
    entry = xckpt.open(path).info("w")
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'w' saved by torch as \['Shard\(0\)'\]"):
        xj.sharding_for(entry, mesh("8"))
    out = xj.load(path, {"w": NamedSharding(mesh("8"), P())})["w"]
    assert same(out, full)


# ---------------------------------------------------------------------------
# Bytes actually read (tensorstore's own file-read counter)


def file_bytes_read() -> int:
    """Chunk-file bytes read: by tensorstore (OCDBT, metadata) and directly (plain files)."""
    from xckpt.native import _fileio

    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        if m["name"] == "/tensorstore/kvstore/file/bytes_read":
            return int(m["values"][0]["value"]) + _fileio.bytes_read()
    return _fileio.bytes_read()


def bytes_for(fn: object) -> int:
    before = file_bytes_read()
    fn()  # type: ignore[operator]
    return file_bytes_read() - before


def test_bytes_read_one_eighth_of_whole_saved_tensor(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor saved as one chunk, loaded 8 ways: each device box reads ~1/8.

    A chunk's zarr grid is ~16 MiB (xckpt/storage.py), so the claim needs a chunk
    of several grid cells; the test lowers the writer's grid target to 1 MiB
    (our own tuning knob) instead of writing 128 MiB.
    """
    monkeypatch.setattr(xckpt.native.writer, "inner_chunk_shape",
                        functools.partial(xckpt.native._zarr.inner_chunk_shape, target=1 << 20))
    path = str(tmp_path)
    full = data((1024, 2048))  # 8 MiB float32, one chunk, grid of 128-row cells
    xj.save({"w": jax.device_put(full, sharding("8"))}, path)  # replicated: one box, one chunk
    entry = xckpt.open(path).info("w")
    assert len(entry.chunks) == 1 and entry.chunks[0].grid == (128, 2048)
    nbytes = full.nbytes
    s = sharding("8", "x")
    # One device's box, read exactly as load() reads it.
    ck = xckpt.open(path)
    box = xckpt.layout.box_from_index(full.shape, s.devices_indices_map(full.shape)[jax.devices()[3]])
    out = np.empty(box.shape, np.float32)
    one = bytes_for(lambda: ck.read_into([("w", box, out)]))
    assert same(out, full[384:512])
    assert nbytes / 8 <= one < nbytes / 8 * 1.05
    # The whole 8-way load: every byte about once, not 8 times (no whole-tensor reads).
    got: dict[str, jax.Array] = {}
    total = bytes_for(lambda: got.update(xj.load(path, {"w": s})))
    assert same(got["w"], full)
    assert nbytes <= total < nbytes * 1.05


def test_bytes_read_replicated_box_read_once(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved by 8 shards; a target that replicates each box on 2 devices reads each once."""
    path = str(tmp_path)
    full = data((512, 2048))  # 4 MiB: 8 row chunks of 512 KiB (stored as arrays, not packed)
    xj.save({"w": jax.device_put(full, sharding("8", "x"))}, path)
    entry = xckpt.open(path).info("w")
    assert len(entry.chunks) == 8 and all(c.form == "array" for c in entry.chunks)
    s = sharding("4x2", "a")  # 4 distinct row boxes, each on 2 devices
    asked: list[tuple[str, Box]] = []
    real = xckpt.Checkpoint.read_into

    def spy(self: xckpt.Checkpoint, items: list, **kw: object) -> None:
        items = list(items)
        asked.extend((n, b) for n, b, _ in items)
        real(self, items, **kw)

    monkeypatch.setattr(xckpt.Checkpoint, "read_into", spy)  # our own reader, observed only
    got: dict[str, jax.Array] = {}
    total = bytes_for(lambda: got.update(xj.load(path, {"w": s})))
    assert same(got["w"], full)
    assert sorted(asked, key=lambda x: x[1].offset) == [("w", Box((r, 0), (128, 2048))) for r in range(0, 512, 128)]
    assert full.nbytes <= total < full.nbytes * 1.05
    # A device box of 1/8 (rows 64:128 of an 8-way row split) reads one saved chunk: 1/8.
    box = Box((64, 0), (64, 2048))
    ck = xckpt.open(path)
    out = np.empty(box.shape, np.float32)
    one = bytes_for(lambda: ck.read_into([("w", box, out)]))
    assert same(out, full[64:128])
    assert full.nbytes / 8 <= one < full.nbytes / 8 * 1.05


# ---------------------------------------------------------------------------
# Host buffers: one mapping per array, pre-faulted while the reads run


def shard_pointers(arr: jax.Array) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct device buffer of ``arr``, by address."""
    seen = {s.data.unsafe_buffer_pointer(): s.data.nbytes for s in arr.addressable_shards}
    return sorted(seen.items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_array_boxes_adopted_from_one_mapping(tmp_path: object, dtype: str) -> None:
    """An array of >= 1 MiB: its device boxes are 64-byte aligned slices of one mapping,
    read in place and adopted by the CPU devices without a copy (1x memory), bit-exact."""
    dt = xckpt.manifest.numpy_dtype(dtype)
    full = np.random.default_rng(7).integers(0, 1 << 16, size=(512, 1024), dtype=np.uint16)
    full = full.view(dt) if dt.itemsize == 2 else data((512, 1024), seed=7)  # bf16: every bit pattern
    path = str(tmp_path)
    xj.save({"w": jax.device_put(full, sharding("8", "x"))}, path)
    for s in (sharding("2x4", "a", "b"), sharding("4x2", None, ("b", "a")), sharding("8")):
        out = xj.load(path, {"w": s})["w"]
        assert out.sharding == s and out.dtype == dt and same(out, full)
        for shard in out.addressable_shards:
            assert same(shard.data, full[shard.index])
        ptrs = shard_pointers(out)
        assert all(p % 64 == 0 for p, _ in ptrs)
        # consecutive boxes, no gaps: one mapping holds them all (replicated: one box)
        assert all(p + n == q for (p, n), (q, _) in zip(ptrs, ptrs[1:]))


def test_every_array_mapped_round_trips(root: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """With the mapping threshold at 1 byte every array (uneven saved layouts, an empty
    array, bf16) takes the mapped, pre-faulted path and still loads bit-exact."""
    monkeypatch.setattr(jax_load, "_MAP_MIN", 1)
    for case in ("2x4-two-dims", "8-dim1", "2x4-replicated"):
        path, w, b = saved_checkpoint(case, root)
        for target in ("replicated-8", "4x2-tuple-dim1", "8-dim0"):
            s = sharding(TARGETS[target][0], *TARGETS[target][1])
            out = xj.load(path, {"params": {"w": s, "b": s}})["params"]
            assert same(out["w"], w) and same(out["b"], b)
        out = xj.load(path, {"params": {"w": s, "b": s}}, host_budget=1)["params"]  # a batch per array
        assert same(out["w"], w) and same(out["b"], b)
    upath = str(tmp_path / "uneven")
    full = data((10, 8), jnp.bfloat16, seed=8)
    writers = [xckpt.Writer(upath, rank=r, world_size=4, save_id="u") for r in range(4)]
    for r, (start, size) in enumerate(xckpt.layout.chunk_sizes(10, 4)):  # 3,3,3,1 rows
        writers[r].write("w", full[start:start + size], global_shape=(10, 8), offset=(start, 0))
    for wr in writers:
        wr.commit()
    out = xj.load(upath, {"w": sharding("2x4", None, ("a", "b"))})["w"]
    assert same(out, full)
    epath = str(tmp_path / "empty")
    xj.save({"e": jax.device_put(np.zeros((0, 8), np.float32), sharding("8", None, "x")),
             "f": jax.device_put(data((8, 8)), sharding("8", "x"))}, epath)
    out = xj.load(epath, {"e": sharding("2x4", "a", "b"), "f": sharding("8")})
    assert out["e"].shape == (0, 8) and same(out["e"], np.zeros((0, 8), np.float32))
    assert same(out["f"], data((8, 8)))


def test_prefault_refused_by_kernel_still_loads(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-faulting is an optimisation: where the kernel refuses the advice (EINVAL, as
    before Linux 5.14) the helper stops and the reads fault the pages in themselves."""
    monkeypatch.setattr(jax_load, "_MADV_POPULATE_WRITE", -1)  # no such advice
    full = data((512, 1024), seed=9)
    xj.save({"w": jax.device_put(full, sharding("8", "x"))}, str(tmp_path))
    out = xj.load(str(tmp_path), {"w": sharding("2x4", "b", "a")})["w"]
    assert same(out, full)


def test_failed_read_stops_the_prefault_helper(tmp_path: object) -> None:
    """A damaged chunk raises CorruptChunkError naming the tensor, and the pre-fault
    helper thread is stopped before load() raises."""
    full = data((512, 1024), seed=10)
    xj.save({"w": jax.device_put(full, sharding("8"))}, str(tmp_path))  # one 2 MiB chunk
    files = [f for f in Path(str(tmp_path), "data").rglob("*")
             if f.is_file() and f.name != "zarr.json" and f.stat().st_size >= full.nbytes]
    raw = bytearray(files[0].read_bytes())
    pos = bytes(raw).find(full.tobytes()[:64])
    assert pos >= 0
    raw[pos + 100_000] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*(checksum|crc32)"):
        xj.load(str(tmp_path), {"w": sharding("8", "x")})
    assert not [t for t in threading.enumerate() if t.name == "xckpt-populate"]
