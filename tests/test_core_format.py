"""The format core: round trips, rank-local merges, objects, and every error path."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptChunkError,
    DtypeMismatchError,
    FormatVersionError,
    IncompleteCheckpointError,
    LayoutError,
    ManifestError,
    MissingEntryError,
    ObjectError,
    ShapeMismatchError,
    XckptError,
)
from xckpt.layout import Box

DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]  # fmt: skip


def random_array(dtype: str, shape, seed=0) -> np.ndarray:
    """Random bits of every pattern the dtype can hold (bit-exact checks need NaNs too)."""
    dt = xckpt.manifest.numpy_dtype(dtype)
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=(int(np.prod(shape)) * dt.itemsize,), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("form", ["packed", "array"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype, form):
    shape = (40, 7) if form == "packed" else (1200, 300)
    a = random_array(dtype, shape)
    xckpt.save({"a": a}, tmp_path / "c")
    ck = xckpt.open(tmp_path / "c")
    assert ck.info("a").chunks[0].form == form
    assert same_bits(ck.read("a"), a)
    assert same_bits(ck.read("a", (slice(3, 17), slice(1, 5))), a[3:17, 1:5])


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_scalars_empty_tensors_and_objects(tmp_path, storage):
    data = {
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.int64),
        "bf16": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3),
        "step": 17,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam", 3: [1, None]},
        "blob": b"\x00\x01" * 10_000,
        "small_blob": b"xy",
        "nan": float("nan"),
        "np_scalar": np.int32(7),
    }
    xckpt.save(data, tmp_path / "c", storage=storage)
    got = xckpt.load(tmp_path / "c")
    assert set(got) == set(data)
    for k in ("scalar", "empty", "bf16"):
        assert same_bits(got[k], data[k])
    assert got["step"] == 17 and got["cfg"] == data["cfg"] and isinstance(got["cfg"]["betas"], tuple)
    assert got["blob"] == data["blob"] and got["small_blob"] == b"xy"
    assert np.isnan(got["nan"]) and got["np_scalar"] == 7 and got["np_scalar"].dtype == np.int32
    assert xckpt.open(tmp_path / "c").info("empty").chunks == ()


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_unpacked_scalar_chunks_read_into_a_callers_0d_buffer(tmp_path, storage):
    """A 0-d chunk stored as an array (pack_threshold=0) fills a caller's 0-d buffer:
    `out[()]` is a scalar copy, so every read path must write through a view."""
    data = {"s": np.array(3.5, dtype=np.float32), "b": np.array(-2, dtype=np.int8)}
    xckpt.save(data, tmp_path / "c", storage=storage, pack_threshold=0)
    ck = xckpt.open(tmp_path / "c")
    assert ck.info("s").chunks[0].form != "packed"
    outs = {k: np.zeros((), dtype=v.dtype) for k, v in data.items()}
    ck.read_into([(k, Box((), ()), outs[k]) for k in data])
    assert outs == data


def write_ranks(path, full: np.ndarray, boxes_per_rank, save_id="s1", **kw):
    world = len(boxes_per_rank)
    for r, boxes in enumerate(boxes_per_rank):
        w = xckpt.Writer(path, rank=r, world_size=world, save_id=save_id, **kw)
        w.declare("t", full.dtype, full.shape)
        for b in boxes:
            w.write("t", full[b.slices()], global_shape=full.shape, offset=b.offset)
        w.commit()


def test_several_writers_read_back_in_another_layout(tmp_path):
    full = random_array("float32", (10, 6), seed=3)
    # uneven rows over 4 ranks (3,3,3,1) with a large chunk threshold of 0 forcing arrays
    boxes = [[Box((0, 0), (3, 6))], [Box((3, 0), (3, 6))], [Box((6, 0), (3, 6))], [Box((9, 0), (1, 6))]]
    write_ranks(tmp_path / "c", full, boxes, pack_threshold=0)
    ck = xckpt.open(tmp_path / "c")
    assert ck.world_size == 4 and len(ck.info("t").chunks) == 4
    for r0, r1 in [(0, 5), (5, 10), (2, 9)]:
        for c0, c1 in [(0, 3), (3, 6)]:
            assert same_bits(ck.read("t", (slice(r0, r1), slice(c0, c1))), full[r0:r1, c0:c1])


def test_memory_and_file_urls(tmp_path):
    a = random_array("int32", (5, 5))
    xckpt.save({"a": a}, "memory://ckpt-test/a")
    assert same_bits(xckpt.load("memory://ckpt-test/a")["a"], a)
    xckpt.save({"a": a}, f"file://{tmp_path}/b")
    assert same_bits(xckpt.load(tmp_path / "b")["a"], a)


def test_rank_local_missing_rank_is_incomplete(tmp_path):
    full = random_array("float32", (4, 2))
    w = xckpt.Writer(tmp_path / "c", rank=1, world_size=3, save_id="s1")
    w.write("t", full[2:], global_shape=(4, 2), offset=(2, 0))
    w.commit()
    with pytest.raises(IncompleteCheckpointError, match=r"of 3 ranks is incomplete: rank manifests missing: \[0, 2\]"):
        xckpt.open(tmp_path / "c")


def test_rank_local_many_ranks_merge_and_name_the_missing_ones(tmp_path):
    """12 rank manifests (read concurrently from a local directory): merged bit for bit;
    with three removed, the error names them."""
    full = random_array("float32", (24, 3), seed=5)
    for r in range(12):
        w = xckpt.Writer(tmp_path / "c", rank=r, world_size=12, save_id="s")
        w.write("t", full[2 * r : 2 * r + 2], global_shape=(24, 3), offset=(2 * r, 0))
        w.commit()
    assert same_bits(xckpt.load(tmp_path / "c")["t"], full)
    for r in (3, 7, 11):
        (tmp_path / "c" / "ranks" / f"{r}.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"of 12 ranks is incomplete: rank manifests missing: \[3, 7, 11\]"):
        xckpt.open(tmp_path / "c")


def test_rank_local_mixed_saves_are_incomplete(tmp_path):
    full = random_array("float32", (4, 2))
    for r, sid in [(0, "step-1"), (1, "step-2")]:
        w = xckpt.Writer(tmp_path / "c", rank=r, world_size=2, save_id=sid)
        w.write("t", full[2 * r : 2 * r + 2], global_shape=(4, 2), offset=(2 * r, 0))
        w.commit()
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\] belong to another save"):
        xckpt.open(tmp_path / "c")


def test_finalize_writes_merged_manifest(tmp_path):
    full = random_array("float32", (4, 2))
    write_ranks(tmp_path / "c", full, [[Box((0, 0), (2, 2))], [Box((2, 0), (2, 2))]])
    assert not (tmp_path / "c" / "xckpt.json").exists()
    xckpt.finalize(tmp_path / "c", world_size=2, save_id="s1")
    merged = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert merged["rank"] is None and len(merged["tensors"]["t"]["chunks"]) == 2
    assert same_bits(xckpt.load(tmp_path / "c")["t"], full)


def test_gaps_and_overlaps_are_layout_errors(tmp_path):
    full = random_array("float32", (6, 2))
    write_ranks(tmp_path / "gap", full, [[Box((0, 0), (2, 2))], [Box((3, 0), (3, 2))]])
    with pytest.raises(LayoutError, match=r"tensor 't'.*cover 10 of 12 elements.*gaps"):
        xckpt.open(tmp_path / "gap")
    write_ranks(tmp_path / "ovl", full, [[Box((0, 0), (4, 2))], [Box((3, 0), (3, 2))]])
    with pytest.raises(LayoutError, match=r"tensor 't'.*overlap in \[3:4, 0:2\]"):
        xckpt.open(tmp_path / "ovl")


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "zarr.json" and "ranks" not in p.parts and p.name != "xckpt.json")


@pytest.mark.parametrize("storage", ["plain", "ocdbt", "files"])
@pytest.mark.parametrize("form", ["array", "packed"])
def test_flipped_byte_is_a_corrupt_chunk_naming_the_tensor(tmp_path, storage, form):
    a = random_array("float32", (300, 300) if form == "array" else (100, 100))
    xckpt.save({"weights": a}, tmp_path / "c", storage=storage)
    files = [f for f in chunk_files(tmp_path / "c" / "data") if f.stat().st_size >= a.nbytes]
    assert files, "no data file holds the chunk"
    f = files[0]
    raw = bytearray(f.read_bytes())
    # flip a byte inside the stored values: find them by content
    pos = bytes(raw).find(a.tobytes()[:64])
    assert pos >= 0
    raw[pos + 10] ^= 0xFF
    f.write_bytes(bytes(raw))
    ck = xckpt.open(tmp_path / "c")
    with pytest.raises(CorruptChunkError, match=r"tensor 'weights'.*(checksum|crc32)"):
        ck.read("weights")
    problems = ck.verify()
    assert len(problems) == 1 and "weights" in problems[0]


def test_missing_chunk_data_is_corrupt(tmp_path):
    a = random_array("float32", (300, 300))
    xckpt.save({"w": a}, tmp_path / "c", storage="plain")
    for f in chunk_files(tmp_path / "c" / "data"):
        f.unlink()
    with pytest.raises(CorruptChunkError, match="tensor 'w'"):
        xckpt.open(tmp_path / "c").read("w")


def manifest_path(root: Path) -> Path:
    return root / "xckpt.json"


def edit_manifest(root: Path, fn) -> None:
    """Edit the manifests as a hostile writer would: content changed, checksum recomputed."""
    for p in [root / "xckpt.json", root / "ranks" / "0.json"]:
        d = json.loads(p.read_text())
        fn(d)
        p.write_bytes(xckpt.manifest.manifest_bytes(d))


@pytest.fixture
def saved(tmp_path):
    xckpt.save({"big": random_array("float32", (300, 300)), "small": np.arange(4)}, tmp_path / "c")
    return tmp_path / "c"


def test_truncated_manifest(saved):
    p = manifest_path(saved)
    p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(ManifestError, match=r"xckpt.json is not valid JSON.*truncated or corrupt"):
        xckpt.open(saved)


def test_unknown_version_and_format(saved):
    edit_manifest(saved, lambda d: d.update(version=99))
    with pytest.raises(FormatVersionError, match=r"format version 99 is not supported.*upgrade xckpt"):
        xckpt.open(saved)
    edit_manifest(saved, lambda d: d.update(version=1, format="orbax"))
    with pytest.raises(FormatVersionError, match="not an xckpt manifest"):
        xckpt.open(saved)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "data/0/../../x", "data/0/t/../../../x", "ranks/0.json"])
def test_chunk_key_leaving_the_checkpoint_is_refused(saved, key):
    def bad(d):
        d["tensors"]["big"]["chunks"][0]["key"] = key

    edit_manifest(saved, bad)
    with pytest.raises(ManifestError, match=r"tensor 'big'.*refusing a key that could leave the checkpoint"):
        xckpt.open(saved)


def test_byte_count_disagreeing_with_the_box_is_refused(saved):
    def bad(d):
        d["tensors"]["big"]["chunks"][0]["nbytes"] = 12

    edit_manifest(saved, bad)
    with pytest.raises(ManifestError, match=r"tensor 'big': chunk \[0:300, 0:300\] claims 12 bytes but holds 360000"):
        xckpt.open(saved)


def test_shape_disagreeing_with_the_chunks_is_refused(saved):
    def bad(d):
        d["tensors"]["big"]["shape"] = [400, 300]

    edit_manifest(saved, bad)
    with pytest.raises(LayoutError, match=r"tensor 'big'.*gaps"):
        xckpt.open(saved)


def test_unknown_dtype_is_refused(saved):
    edit_manifest(saved, lambda d: d["tensors"]["big"].update(dtype="object"))
    with pytest.raises(ManifestError, match="tensor 'big': unknown dtype 'object'"):
        xckpt.open(saved)


def test_loading_never_unpickles(saved, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("pickle used on a load path")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    xckpt.load(saved)


def test_save_refuses_to_overwrite(saved):
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        xckpt.save({"x": np.zeros(3)}, saved)
    xckpt.save({"x": np.ones(3)}, saved, overwrite=True)
    got = xckpt.load(saved)
    assert list(got) == ["x"] and same_bits(got["x"], np.ones(3))


def test_rank_local_overwrite_needs_explicit_new_save_id(tmp_path):
    full = random_array("float32", (4, 2))
    write_ranks(tmp_path / "c", full, [[Box((0, 0), (2, 2))], [Box((2, 0), (2, 2))]], save_id="1")
    with pytest.raises(XckptError, match="needs an explicit save_id"):
        xckpt.Writer(tmp_path / "c", rank=0, world_size=2, overwrite=True)
    with pytest.raises(XckptError, match="same save_id; pass a new save_id"):
        xckpt.Writer(tmp_path / "c", rank=0, world_size=2, save_id="1", overwrite=True)
    # Part way through an overwrite the location is not accepted as complete.
    w = xckpt.Writer(tmp_path / "c", rank=0, world_size=2, save_id="2", overwrite=True)
    w.write("t", full[:2] + 1, global_shape=(4, 2), offset=(0, 0))
    w.commit()
    with pytest.raises(IncompleteCheckpointError, match="belong to another save"):
        xckpt.open(tmp_path / "c")
    w = xckpt.Writer(tmp_path / "c", rank=1, world_size=2, save_id="2", overwrite=True)
    w.write("t", full[2:] + 1, global_shape=(4, 2), offset=(2, 0))
    w.commit()
    assert same_bits(xckpt.load(tmp_path / "c")["t"], full + 1)


def test_uncommitted_save_is_not_a_checkpoint(tmp_path):
    w = xckpt.Writer(tmp_path / "c")
    w.write("t", random_array("float32", (300, 300)))
    w._flush()  # data is on disk, the manifest is not
    with pytest.raises(CheckpointNotFoundError, match="no xckpt checkpoint"):
        xckpt.open(tmp_path / "c")


def test_per_rank_objects(tmp_path):
    for r in range(2):
        w = xckpt.Writer(tmp_path / "c", rank=r, world_size=2, save_id="s")
        w.write_object("rng", {"seed": r}, per_rank=True)
        w.write_object("step", 9)
        w.commit()
    ck = xckpt.open(tmp_path / "c")
    assert ck.objects(rank=1) == {"rng": {"seed": 1}, "step": 9}
    assert ck.objects(world_size=3, per_rank="list") == {"rng": [{"seed": 0}, {"seed": 1}], "step": 9}
    with pytest.raises(ObjectError, match=r"object 'rng' was saved per rank by 2 ranks and is loaded at world size 3.*per_rank='list'"):
        ck.objects(world_size=3)
    with pytest.raises(ObjectError, match="per_rank='list'"):
        xckpt.load(tmp_path / "c")


def test_replicated_object_disagreeing_between_ranks(tmp_path):
    for r in range(2):
        w = xckpt.Writer(tmp_path / "c", rank=r, world_size=2, save_id="s")
        w.write_object("step", r)
        w.commit()
    with pytest.raises(ManifestError, match=r"replicated object 'step' differs between rank 0 and rank 1.*per_rank=True"):
        xckpt.open(tmp_path / "c")


def test_unstorable_object(tmp_path):
    with pytest.raises(ObjectError, match=r"object 'fn' of type function cannot be stored.*never pickles"):
        xckpt.save({"fn": lambda: 0}, tmp_path / "c")


def test_read_errors_name_the_tensor(saved):
    ck = xckpt.open(saved)
    with pytest.raises(MissingEntryError, match=r"has no tensor 'nope'"):
        ck.read("nope")
    with pytest.raises(DtypeMismatchError, match=r"tensor 'big': saved as float32, target is float64"):
        ck.read_into([("big", Box((0, 0), (2, 2)), np.empty((2, 2), np.float64))])
    with pytest.raises(ShapeMismatchError, match=r"tensor 'big': target box \[0:400, 0:2\]"):
        ck.read_into([("big", Box((0, 0), (400, 2)), np.empty((400, 2), np.float32))])


def test_writer_rejects_inconsistent_boxes(tmp_path):
    w = xckpt.Writer(tmp_path / "c")
    with pytest.raises(LayoutError, match=r"does not fit in the global shape \(4,\)"):
        w.write("t", np.zeros(3), global_shape=(4,), offset=(2,))
    with pytest.raises(LayoutError, match="give both global_shape and offset"):
        w.write("t", np.zeros(3), global_shape=(4,))
    w.write("t", np.zeros(2), global_shape=(4,), offset=(0,))
    with pytest.raises(LayoutError, match=r"written as float64\[4\] and now as float32\[4\]"):
        w.write("t", np.zeros(2, np.float32), global_shape=(4,), offset=(2,))


def test_structure_change_between_saves_is_saved_whole(tmp_path):
    first = {"a": np.arange(3), "step": 1}
    second = {"a": np.arange(3), "b": np.ones((2, 2)), "step": 2, "sched": {"warmup": 10}}
    xckpt.save(first, tmp_path / "one")
    xckpt.save(second, tmp_path / "two")
    got = xckpt.load(tmp_path / "two")
    assert set(got) == set(second) and got["sched"] == {"warmup": 10}
    assert set(xckpt.load(tmp_path / "one")) == set(first)


def test_many_small_tensors_are_packed_into_few_files(tmp_path):
    data = {f"layer{i}.bias": np.full(256, i, np.float32) for i in range(2000)}
    xckpt.save(data, tmp_path / "c")
    files = [p for p in (tmp_path / "c").rglob("*") if p.is_file()]
    assert len(files) < 20
    got = xckpt.load(tmp_path / "c")
    assert all(same_bits(got[k], v) for k, v in data.items())


@pytest.mark.parametrize("storage", [None, "ocdbt"])
def test_chunks_readable_with_plain_tensorstore(tmp_path, storage):
    """The README recipe: follow the manifest, open the chunk's zarr v3 array
    (a local directory defaults to "files": the array's own directory, chunk keys c.<i>.<j>)."""
    import tensorstore as ts

    a = random_array("float32", (300, 300))
    xckpt.save({"w": a}, tmp_path / "c", **({"storage": storage} if storage else {}))
    m = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    chunk = m["tensors"]["w"]["chunks"][0]
    rank_dir, rest = chunk["key"].split("/", 2)[1], chunk["key"].split("/", 2)[2]
    assert m["storage"][rank_dir] == (storage or "files")
    if storage == "ocdbt":
        kvstore: Any = {"driver": "ocdbt", "base": f"file://{tmp_path}/c/data/{rank_dir}/", "path": rest + "/"}
    else:
        kvstore = f"file://{tmp_path}/c/{chunk['key']}/"
    arr = ts.open({"driver": "zarr3", "kvstore": kvstore}).result()
    assert same_bits(arr[10:20, 5:9].read().result(), a[10:20, 5:9])


def test_import_xckpt_imports_no_framework():
    code = "import sys, xckpt, xckpt.layout, xckpt.manifest, xckpt.storage; print(sorted(m for m in ('torch','jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_golden_v1_checkpoint_loads_unchanged():
    """A checkpoint written by format version 1 and checked in; never regenerated silently."""
    root = Path(__file__).parent / "golden" / "v1"
    expect = json.loads((root / "expected.json").read_text())
    got = xckpt.load(root / "ckpt")
    for name, spec in expect["tensors"].items():
        arr = got[name]
        assert arr.dtype == xckpt.manifest.numpy_dtype(spec["dtype"]) and list(arr.shape) == spec["shape"]
        assert arr.tobytes().hex() == spec["hex"]
    for name, value in expect["objects"].items():
        assert got[name] == value
    assert os.path.exists(root / "ckpt" / "xckpt.json")


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_all_zero_chunks_are_stored(tmp_path, storage):
    """tensorstore skips chunks equal to the fill value unless told otherwise; a reader
    that treats a missing chunk as damage needs them on disk."""
    z = np.zeros((1200, 300), dtype=np.float32)
    xckpt.save({"z": z}, tmp_path / "c", storage=storage)
    assert same_bits(xckpt.load(tmp_path / "c")["z"], z)


@pytest.mark.parametrize("shape", [(6,), (1200, 300)], ids=["packed", "array"])
def test_big_endian_arrays_keep_their_values(tmp_path, shape):
    a = np.arange(np.prod(shape), dtype=">f4").reshape(shape)
    xckpt.save({"be": a}, tmp_path / "c")
    got = xckpt.load(tmp_path / "c")["be"]
    assert got.dtype == np.float32 and np.array_equal(got, a)
