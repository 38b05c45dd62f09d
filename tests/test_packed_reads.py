"""Reads of packed small tensors: spans of whole zarr chunks, checked and copied out on
the read threads (direct) or through tensorstore (OCDBT), bit for bit, and every error
naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
import xckpt.native._zarr
import xckpt.native.reader
from xckpt.errors import CorruptChunkError
from xckpt.layout import Box
from xckpt.native import _fileio, _packedio

GRID = 4096  # packed zarr chunk length forced below: tensors straddle chunks and spans


def _tensors() -> dict[str, np.ndarray]:
    """Sizes around the zarr chunk length (a byte, exact multiples, several chunks), bf16 too."""
    rng = np.random.default_rng(3)
    out = {}
    for i, n in enumerate([1, 7, 1024, 1023, 4096, 4097, 9000, 3, 12288, 515, 2, 20000]):
        raw = rng.integers(0, 256, size=n, dtype=np.uint8)
        out[f"u8_{i}"] = raw
    out["bf16"] = rng.standard_normal((33, 17)).astype(ml_dtypes.bfloat16)
    out["f32_2d"] = rng.standard_normal((40, 50)).astype(np.float32)
    out["i64_3d"] = rng.integers(-(2**62), 2**62, size=(3, 5, 7))
    return out


@pytest.fixture
def small_grid(monkeypatch):
    monkeypatch.setattr(xckpt.native._zarr, "PACKED_CHUNK_BYTES", GRID)
    monkeypatch.setattr(xckpt.native.reader, "_PACKED_SPAN", 2 * GRID)  # many spans, tensors across their ends


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("storage", ["files", "plain", "ocdbt"])
def test_packed_spans_round_trip_bit_exact(tmp_path, small_grid, storage, reads):
    data = _tensors()
    xckpt.save(data, tmp_path / "c", storage=storage)
    ck = xckpt.open(tmp_path / "c")
    assert all(ck.info(n).chunks[0].form == "packed" for n in data)
    got = ck.read_all()
    assert set(got) == set(data)
    for n, a in data.items():
        assert got[n].dtype == a.dtype and got[n].shape == a.shape and _bits(got[n]) == _bits(a), n


@pytest.mark.parametrize("storage", ["files", "ocdbt"])
def test_packed_boxes_whole_and_partial_in_one_read(tmp_path, small_grid, storage, reads):
    data = _tensors()
    xckpt.save(data, tmp_path / "c", storage=storage)
    ck = xckpt.open(tmp_path / "c")
    parts = [
        ("f32_2d", Box((10, 5), (20, 30))),  # a box of a packed tensor: copied out by slices
        ("u8_11", Box((100,), (19000,))),
        ("bf16", Box((0, 0), (33, 17))),  # whole
        ("u8_6", Box((0,), (9000,))),
        ("i64_3d", Box((1, 0, 2), (2, 5, 3))),
    ]
    outs = [np.full(b.shape, 0, data[n].dtype) for n, b in parts]
    # A non-contiguous output (a column slice of a larger array) is filled in place too.
    wide = np.zeros((33, 40), ml_dtypes.bfloat16)
    items = [(n, b, o) for (n, b), o in zip(parts, outs)] + [("bf16", Box((0, 0), (33, 17)), wide[:, 3:20])]
    ck.read_into(items)
    for (n, b), o in zip(parts, outs):
        assert _bits(o) == _bits(data[n][b.slices()]), n
    assert _bits(wide[:, 3:20]) == _bits(data["bf16"]) and not wide[:, :3].view(np.uint16).any()


def test_direct_packed_read_reads_each_zarr_chunk_once(tmp_path, small_grid):
    data = _tensors()
    xckpt.save(data, tmp_path / "c", storage="files")
    ck = xckpt.open(tmp_path / "c")
    grid, count = _layout(ck, data)
    assert count > 8
    before = _fileio.bytes_read()
    ck.read_all()
    # The shard's index once, then every zarr chunk once, with its crc32c.
    assert _fileio.bytes_read() - before == 16 * count + 4 + count * (grid + 4)


def _layout(ck: xckpt.Checkpoint, data: dict) -> tuple[int, int]:
    """The packed array's zarr chunk length and count (equal pieces of at most GRID)."""
    size = max(c.byte_offset + c.nbytes + 4 for n in data for c in ck.info(n).chunks)  # (+ the last one's crc32)
    grid = xckpt.native._zarr.packed_grid(size)
    assert grid <= GRID
    return grid, -(-size // grid)


def _packed_file(root: Path) -> Path:
    (f,) = [p for p in (root / "data").rglob("*") if p.is_file() and p.name != "zarr.json" and p.parent.name == "packed"]
    return f


def test_flipped_byte_in_a_later_zarr_chunk_names_the_tensor_and_chunk(tmp_path, small_grid, reads):
    data = _tensors()
    xckpt.save(data, tmp_path / "c", storage="files")
    ck = xckpt.open(tmp_path / "c")
    c = ck.info("u8_11").chunks[0]
    f = _packed_file(tmp_path / "c")
    raw = bytearray(f.read_bytes())
    grid, count = _layout(ck, data)
    k = (c.byte_offset + 100) // grid  # the zarr chunk holding byte 100 of u8_11
    assert k > 0
    raw[16 * count + 4 + k * (grid + 4) + (c.byte_offset + 100) % grid] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=rf"tensor 'u8_11'.*\(packed\).*zarr chunk \[{k}\]\) fails its crc32c"):
        xckpt.open(tmp_path / "c").read("u8_11")
    # Tensors in other spans still read (the damage is confined to its zarr chunk).
    assert _bits(xckpt.open(tmp_path / "c").read("u8_0")) == _bits(data["u8_0"])


def _set_crc(root: Path, name: str, crc: int) -> None:
    """A hostile writer's edit: a packed tensor's crc32 changed, the manifest re-signed."""
    for p in [root / "xckpt.json", root / "ranks" / "0.json"]:
        d = json.loads(p.read_text())
        t = d["tensors"][name]
        if isinstance(t, list):  # a version 4 row: [dtype, shape, rank, byte_offset, crc32]
            t[4] = crc
        else:
            t["chunks"][0]["crc32"] = crc
        p.write_bytes(xckpt.manifest.manifest_bytes(d))


@pytest.mark.parametrize("storage", ["files", "ocdbt"])
def test_packed_tensor_failing_its_manifest_crc32_is_corrupt(tmp_path, small_grid, storage):
    data = _tensors()
    xckpt.save(data, tmp_path / "c", storage=storage)
    good = xckpt.open(tmp_path / "c").info("u8_6").chunks[0].crc32
    _set_crc(tmp_path / "c", "u8_6", good ^ 1)
    ck = xckpt.open(tmp_path / "c")
    with pytest.raises(CorruptChunkError, match=r"tensor 'u8_6'.*packed bytes fail their crc32 check.*restore it"):
        ck.read_all()
    assert _bits(ck.read("u8_5")) == _bits(data["u8_5"])


def _grid_ckpt(root: Path, storage: str) -> dict[str, np.ndarray]:
    """Eight writers: `wide` in cells of 25,000 bytes (packed, each across several zarr chunks
    and spans), `tiny` in cells of 24 bytes, rank 0 a small vector first (cells at different
    byte offsets); rank-local, not finalized."""
    rng = np.random.default_rng(9)
    data = {"wide": rng.standard_normal((400, 125)).astype(np.float32),
            "tiny": rng.integers(-128, 127, size=(64, 3), dtype=np.int8), "v": np.arange(7, dtype=np.int16)}
    for r in range(8):
        w = xckpt.Writer(root, rank=r, world_size=8, save_id="g", storage=storage)
        if r == 0:
            w.write("v", data["v"])
        w.write("wide", data["wide"][50 * r : 50 * r + 50], global_shape=(400, 125), offset=(50 * r, 0))
        w.write("tiny", data["tiny"][8 * r : 8 * r + 8], global_shape=(64, 3), offset=(8 * r, 0))
        w.commit()
    return data


@pytest.mark.parametrize("storage", ["files", "ocdbt"])
def test_grid_packed_cells_carry_their_crc32_after_their_bytes(tmp_path, small_grid, storage):
    """Version 6: a packed chunk's crc32 follows its bytes, so a merged grid lists none; reads
    (whole, partial, across spans) and verify take it from the data, rank-local or merged."""
    data = _grid_ckpt(tmp_path / "c", storage)
    for merged in (False, True):
        if merged:
            xckpt.finalize(tmp_path / "c", world_size=8, save_id="g")
            doc = json.loads((tmp_path / "c" / "xckpt.json").read_bytes())
            assert {k for n in ("wide", "tiny") for k in doc["tensors"][n]["grid"]["packed"]} == {"key", "byte_offset"}
        ck = xckpt.open(tmp_path / "c")
        assert ck.info("wide").is_grid and all(c.form == "packed" and c.crc32 is None for c in ck.info("wide").chunks)
        got = ck.read_all()
        assert all(_bits(got[n]) == _bits(a) for n, a in data.items())
        assert _bits(ck.read("wide", (slice(45, 160), slice(3, 90)))) == _bits(data["wide"][45:160, 3:90])
        assert ck.verify() == []


def test_grid_packed_cell_failing_its_stored_crc32_is_corrupt(tmp_path, small_grid):
    """A cell's crc32 changed in the data (its zarr chunk's crc32c re-made, as a hostile writer
    would): the read and verify name the tensor and cell; the other cells still read."""
    import tensorstore as ts

    data = _grid_ckpt(tmp_path / "c", "files")
    xckpt.finalize(tmp_path / "c", world_size=8, save_id="g")
    ck = xckpt.open(tmp_path / "c")
    (c,) = [c for c in ck.info("tiny").chunks if c.rank == 3]
    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path / 'c' / 'data' / '3' / 'packed'}/"}).result()
    at = c.byte_offset + c.nbytes  # the first byte of its crc32
    arr[at].write(arr[at].read().result() ^ 1).result()
    ck = xckpt.open(tmp_path / "c")
    with pytest.raises(CorruptChunkError, match=r"tensor 'tiny', chunk \[24:32, 0:3\] \(data/3/packed\): packed bytes fail their crc32"):
        ck.read("tiny")
    assert _bits(ck.read("tiny", (slice(0, 24), slice(None)))) == _bits(data["tiny"][:24])
    assert _bits(ck.read("wide")) == _bits(data["wide"])
    (problem,) = ck.verify()
    assert "tensor 'tiny'" in problem and "fail their crc32 check" in problem


def test_missing_packed_shard_is_corrupt_naming_the_tensor(tmp_path, small_grid):
    xckpt.save(_tensors(), tmp_path / "c", storage="files")
    ck = xckpt.open(tmp_path / "c")
    _packed_file(tmp_path / "c").unlink()
    with pytest.raises(CorruptChunkError, match=r"packed chunks of rank 0 .*shard file .* is missing"):
        ck.read_into([("u8_2", Box((0,), (1024,)), np.empty(1024, np.uint8))])


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
    gaps=st.lists(st.integers(0, 3000), min_size=40, max_size=40),
    grid=st.integers(1, 2048),
    per=st.integers(1, 5),
)
def test_plan_spans_covers_each_range_and_reads_each_chunk_once(sizes, gaps, grid, per):
    ranges, pos = [], 0
    for n, gap in zip(sizes, gaps):
        pos += gap
        ranges.append((pos, pos + n))
        pos += n
    spans = _packedio.plan_spans(ranges, grid, per * grid)
    seen: set[int] = set()
    for first, stop, held in spans:
        assert first < stop and first // per == (stop - 1) // per  # inside one block
        assert not seen & set(range(first, stop))  # disjoint ranges: each zarr chunk once
        seen |= set(range(first, stop))
        assert held == sorted(set(held))
        for i in held:  # a range it holds meets it
            assert ranges[i][0] < stop * grid and ranges[i][1] > first * grid
    for i, (start, end) in enumerate(ranges):
        chunks = set(range(start // grid, (end - 1) // grid + 1))
        assert chunks <= seen  # every byte of every range is read
        mine = [(f, s) for f, s, held in spans if i in held]
        assert set().union(*(range(f, s) for f, s in mine)) >= chunks
        assert all(range(f, s) and set(range(f, s)) & chunks for f, s in mine)
    # Nothing is read that no range needs.
    assert seen == set().union(*(range(s // grid, (e - 1) // grid + 1) for s, e in ranges))
