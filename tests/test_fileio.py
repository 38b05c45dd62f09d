"""Direct chunk-file I/O (xckpt.native._fileio): byte-identical to tensorstore's zarr3 files,
every region of every layout read exactly, and damage reported by type and file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import CorruptChunkError
from xckpt.native import _fileio
from xckpt.native._zarr import array_spec

DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]


def _np(dtype: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, dtype)) if hasattr(ml_dtypes, dtype) else np.dtype(dtype)


def _array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, math.prod(shape) * _np(dtype).itemsize, dtype=np.uint8)
    a = raw.view(_np(dtype)).reshape(shape)
    return (a.view(np.uint8) & 1).astype(bool) if dtype == "bool" else a


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


CASES = [
    ((300, 40), (64, 40)),  # row blocks, padded last block
    ((7, 9, 5), (3, 4, 5)),  # trailing dims split: chunks not contiguous in the array
    ((1000,), (256,)),
    ((), ()),  # 0-d
    ((5, 1), (5, 1)),  # one chunk
]


@pytest.mark.parametrize("kind", ["files", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_files_are_byte_identical_to_tensorstore(tmp_path, dtype, kind):
    """What _fileio writes is exactly what tensorstore's zarr3 driver writes (chunk files
    byte for byte, zarr.json as JSON), and each reads the other's."""
    for i, (shape, grid) in enumerate(CASES):
        a = _array(dtype, shape, i)
        ours, theirs = tmp_path / f"ours{i}", tmp_path / f"ts{i}"
        _fileio.write_arrays(str(ours), [_fileio.ArrayWrite("arr", dtype, a, grid, kind)])
        spec = array_spec(f"file://{theirs}/arr/", dtype, shape, grid, kind)
        spec["store_data_equal_to_fill_value"] = True
        ts.open(spec, create=True).result().write(a).result()
        mine, ref = _tree(ours), _tree(theirs)
        assert sorted(mine) == sorted(ref)
        for k in ref:
            if k.endswith("zarr.json"):
                assert json.loads(mine[k]) == json.loads(ref[k]), (dtype, shape)
            else:
                assert mine[k] == ref[k], (dtype, shape, k)
        # tensorstore reads ours, we read theirs
        got = ts.open({"driver": "zarr3", "kvstore": f"file://{ours}/arr/"}).result().read().result()
        assert got.tobytes() == a.tobytes()
        out = np.empty(shape, _np(dtype))
        region = tuple(slice(0, s) for s in shape)
        _fileio.submit_read(str(theirs), _fileio.ChunkRead("arr", shape, grid, region, out, kind)).result()
        assert out.tobytes() == a.tobytes()
        _fileio.check_meta(str(ours), "arr", kind, dtype, shape, grid)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_region_of_any_layout(tmp_path_factory, data):
    """Every region of an array in any grid reads exactly ``a[region]``, into a contiguous
    output or a strided view of a larger one."""
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.integers(1, 12)) for _ in range(ndim))
    grid = tuple(data.draw(st.integers(1, s)) for s in shape)
    a = _array("float32", shape, 1)
    kind = data.draw(st.sampled_from(["files", "plain"]))
    root = tmp_path_factory.mktemp("region")
    _fileio.write_arrays(str(root), [_fileio.ArrayWrite("k", "float32", a, grid, kind)])
    region = []
    for s in shape:
        lo = data.draw(st.integers(0, s - 1))
        region.append(slice(lo, data.draw(st.integers(lo + 1, s))))
    want = a[tuple(region)]
    if data.draw(st.booleans()):
        out = np.zeros(want.shape, np.float32)
        view = out
    else:
        out = np.zeros(tuple(n + 2 for n in want.shape), np.float32)
        view = out[tuple(slice(1, 1 + n) for n in want.shape)]
    mapped = data.draw(st.booleans())  # copied out of mappings (a manager's local tier), or preadv
    _fileio.read_mapped_under(str(root), mapped)
    try:
        _fileio.submit_read(str(root), _fileio.ChunkRead("k", shape, grid, tuple(region), view, kind)).result()
    finally:
        _fileio.read_mapped_under(str(root), False)
    assert view.tobytes() == want.tobytes()


def test_mapped_reads_equal_preadv_short_at_the_end(tmp_path):
    """What `read_mapped_under` changes: the same bytes and counts as `preadv`, from any
    offset, short or none at the end of the file; registrations count."""
    f = tmp_path / "d" / "f"
    f.parent.mkdir()
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    f.write_bytes(data.tobytes())
    _fileio.read_mapped_under(str(tmp_path / "d"), True)
    _fileio.read_mapped_under(str(tmp_path / "d"), True)
    _fileio.read_mapped_under(str(tmp_path / "d"), False)  # one of two dropped: still mapped
    assert _fileio._MAPPED
    fd = os.open(f, os.O_RDONLY)
    try:
        for offset, sizes in [(0, [100, 5000]), (4097, [7000, 3]), (12000, [500, 500]), (len(data) - 1, [4]),
                              (len(data), [8]), (len(data) + 9000, [8]), (5, [0, 64])]:
            got = [np.full(n, 7, np.uint8) for n in sizes]
            n = _fileio._preadv(fd, str(f), got, offset)
            want = data[offset : offset + sum(sizes)]
            assert n == want.size, (offset, sizes)
            assert np.concatenate(got)[:n].tobytes() == want.tobytes()
            assert (np.concatenate(got)[n:] == 7).all()  # nothing written past what was read
    finally:
        os.close(fd)
        _fileio.read_mapped_under(str(tmp_path / "d"), False)
    assert not _fileio._MAPPED


def _saved(tmp_path: Path, storage: str = "files") -> tuple[Path, np.ndarray, str]:
    a = _array("float32", (2048, 300), 3)
    kw = {} if storage == "files" else {"storage": storage}
    xckpt.save({"w": a, "small": np.arange(10.0)}, tmp_path / "c", **kw)
    m = json.loads((tmp_path / "c" / "xckpt.json").read_text())
    assert m["storage"] == {"0": storage}
    return tmp_path / "c", a, m["tensors"]["w"]["chunks"][0]["key"]


def _flip(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x40
    f.write_bytes(bytes(data))


def test_default_local_save_is_one_shard_file_per_box(tmp_path, reads):
    path, a, key = _saved(tmp_path)
    assert sorted(p.name for p in (path / key).iterdir()) == ["c.0.0", "zarr.json"]
    got = xckpt.load(path)
    assert got["w"].tobytes() == a.tobytes() and got["small"].tolist() == list(np.arange(10.0))
    with xckpt.open(path) as ck:
        assert ck.read("w", np.s_[100:1900, 7:200]).tobytes() == a[100:1900, 7:200].tobytes()
        grid = ck.info("w").chunks[0].grid
    # tensorstore reads the shard through its own index
    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{path / key}/"}).result()
    assert arr.read().result().tobytes() == a.tobytes() and grid[0] < 2048


def test_flipped_byte_is_a_corrupt_chunk_error(tmp_path, reads):
    path, a, key = _saved(tmp_path)
    index = 16 * 3 + 4  # 3 zarr chunks of 683 rows
    chunk = 683 * 300 * 4 + 4
    _flip(path / key / "c.0.0", index + chunk + 100)  # inside the second zarr chunk
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*c\.0\.0 \(zarr chunk \[1, 0\]\) fails its crc32c check"):
        xckpt.load(path)
    # a read that does not touch the damaged zarr chunk still works
    with xckpt.open(path) as ck:
        assert ck.read("w", np.s_[0:10]).tobytes() == a[0:10].tobytes()
    _flip(path / key / "c.0.0", 5)  # the index
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*c\.0\.0 \(index\) fails its crc32c check"):
        xckpt.load(path)


def test_missing_and_truncated_shard_files(tmp_path, reads):
    path, _a, key = _saved(tmp_path)
    f = path / key / "c.0.0"
    data = f.read_bytes()
    f.write_bytes(data[:-9])
    # The claim is checked against the file's size (one stat) before anything is allocated.
    with pytest.raises(CorruptChunkError, match=rf"tensor 'w'.*does not match the manifest.*holds {len(data) - 9} "
                       rf"bytes; a box of shape \[2048, 300\] in zarr chunks of \[683, 300\] \(4-byte items\) "
                       rf"needs at least {len(data)}"):
        xckpt.load(path)
    # verify() reads the index and names the zarr chunk that lies past the end.
    (problem,) = xckpt.open(path).verify()
    assert re.search(rf"zarr chunk \[2, 0\]\): index gives bytes .* of a {len(data) - 9}-byte file", problem), problem
    f.write_bytes(data[:30])
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*holds 30 bytes; a box of shape"):
        xckpt.load(path)
    assert "holds 30 bytes, less than its index (52)" in " ".join(xckpt.open(path).verify())
    os.unlink(f)
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*shard file .*c\.0\.0 is missing.*xckpt verify"):
        xckpt.load(path)


def test_plain_chunk_files_damage(tmp_path, reads):
    """Version 2's layout (a file per zarr chunk), still written with storage="plain"."""
    path, _a, key = _saved(tmp_path, "plain")
    _flip(path / key / "c" / "1" / "0", 100)
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*c/1/0 fails its crc32c check"):
        xckpt.load(path)
    _flip(path / key / "c" / "1" / "0", 100)  # repaired
    f = path / key / "c" / "2" / "0"
    data = f.read_bytes()
    f.write_bytes(data[:-9])
    with pytest.raises(CorruptChunkError, match=rf"tensor 'w'.*holds {len(data) - 9} bytes, expected {len(data)}"):
        xckpt.load(path)
    os.unlink(f)
    with pytest.raises(CorruptChunkError, match=r"tensor 'w'.*chunk file .*c/2/0 is missing"):
        xckpt.load(path)


def test_zarr_metadata_that_disagrees_with_the_manifest(tmp_path):
    path, _a, key = _saved(tmp_path)
    meta = json.loads((path / key / "zarr.json").read_text())
    meta["data_type"] = "int32"
    (path / key / "zarr.json").write_text(json.dumps(meta))
    # A load follows the (checksummed) manifest and every chunk's crc32c; zarr.json is
    # for other zarr readers, and verify() checks that it agrees.
    assert xckpt.load(path)["w"].tobytes() == _a.tobytes()
    (problem,) = xckpt.open(path).verify()
    assert re.search(r"tensor 'w'.*data_type is 'int32', the manifest claims 'float32'", problem), problem
    meta["data_type"] = "float32"
    meta["codecs"][0]["configuration"]["index_location"] = "end"
    (path / key / "zarr.json").write_text(json.dumps(meta))
    (problem,) = xckpt.open(path).verify()
    assert re.search(r"tensor 'w'.*zarr.json: layout", problem), problem


def test_percent_in_path_goes_through_tensorstore(tmp_path):
    """A location whose file URL tensorstore would decode differently is never read or
    written directly (both sides then agree on where the files are)."""
    assert _fileio.local_root("file:///a/b%20c/") is None
    assert _fileio.local_root("file:///a/b/") == "/a/b/"
    assert _fileio.local_root("memory://x/") is None


def test_verify_reads_files_directly_and_names_the_damage(tmp_path):
    path, _a, key = _saved(tmp_path)
    with xckpt.open(path) as ck:
        assert ck.verify() == []
    f = path / key / "c.0.0"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # the last zarr chunk's stored crc32c itself
    f.write_bytes(bytes(data))
    with xckpt.open(path) as ck:
        problems = ck.verify()
    assert len(problems) == 1 and "tensor 'w'" in problems[0]
    assert "c.0.0 (zarr chunk [2, 0]) fails its crc32c check" in problems[0]
