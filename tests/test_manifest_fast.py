"""The fast paths for many small tensors agree with the checked ones, field for field.

``TensorEntry._from_json_fast`` accepts an entry only when every check of the checked
parser passes; hypothesis mutates real entries (values at the edges of every bound, wrong
types, removed fields) and compares the two. The writer's dataclasses (built without
``__init__``) equal what the reader parses, and ``Source.read_all``'s whole-chunk path
returns every tensor bit-exact.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import ManifestError, MissingEntryError, XckptError
from xckpt.manifest import (
    MAX_CHUNKS,
    MAX_EXTENT,
    MAX_KEY_LEN,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    Manifest,
    PlacementInfo,
    TensorEntry,
    ValueRange,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
WORLD = 3


def _saved(root: str) -> tuple[dict[str, Any], Manifest]:
    """A real rank manifest: packed, array (with grid), multi-chunk, 0-d, bf16, placement, value range."""
    w = xckpt.Writer(root, rank=1, world_size=WORLD, save_id="fast", pack_threshold=4096)
    w.write("small", np.arange(256, dtype=np.float32))
    w.write("scalar", np.array(3, np.int64))
    w.write("bf", np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3))
    w.write("big", np.ones((64, 32), np.float64))
    w.write("sharded", np.ones((4, 5), np.int16), global_shape=(8, 5), offset=(4, 0),
            placement=PlacementInfo(framework="torch", mesh_shape=(2,), placements=("Shard(0)",)))
    w.write("sharded", np.ones((2, 5), np.int16), global_shape=(8, 5), offset=(0, 0))
    w.write("keys", np.arange(8, dtype=np.int64), value_range=ValueRange(group="g", role="key", domain=(0, 8)),
            chunk_value_range=(0, 8))
    m = w.commit()
    with open(os.path.join(root, "ranks", "1.json"), "rb") as f:
        doc = json.loads(f.read())
    # The entry-object form of every tensor (version 4 writes whole packed tensors as rows).
    doc["tensors"] = {n: t.to_json() for n, t in m.tensors.items()}
    return doc, m


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[dict[str, Any], Manifest]:
    """A real version-4 rank manifest as written, with packed rows (bf16, 0-d and 1-d)."""
    root = str(tmp_path_factory.mktemp("rows") / "c")
    w = xckpt.Writer(root, rank=1, world_size=WORLD, save_id="rows", pack_threshold=4096)
    w.write("small", np.arange(256, dtype=np.float32))
    w.write("scalar", np.array(3, np.int64))
    w.write("bf", np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3))
    w.write("big", np.ones((64, 32), np.float64))
    m = w.commit()
    with open(os.path.join(root, "ranks", "1.json"), "rb") as f:
        return json.loads(f.read()), m


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, Any], Manifest]:
    return _saved(str(tmp_path_factory.mktemp("fast") / "c"))


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except (XckptError, TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
        return e


def _same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (1 == True == 1.0 would hide a difference)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_real_entries_take_the_fast_path(saved):
    doc, m = saved
    for name, d in doc["tensors"].items():
        fast = TensorEntry._from_json_fast(name, d, "w", WORLD)
        assert fast is not None, name
        assert _same(fast, TensorEntry._from_json_checked(name, d, "w", WORLD))
        assert _same(fast, m.tensors[name])  # the writer's unchecked dataclasses equal the parsed ones


def test_writer_manifest_round_trips_exactly(saved):
    _, m = saved
    again = Manifest.loads(m.dumps(), "r")
    assert _same(dict(again.tensors), dict(m.tensors))
    assert again.tensors["small"].box.shape == (256,) and again.tensors["sharded"].boxes[1].offset == (0, 0)
    assert hash(again.tensors["small"].chunks[0]) == hash(m.tensors["small"].chunks[0])


EDGE_INTS = st.sampled_from([
    0, 1, -1, 2, WORLD - 1, WORLD, 255, 256, 1024, MAX_EXTENT, MAX_EXTENT + 1, (1 << 32) - 1, 1 << 32,
    MAX_TENSOR_BYTES - 1, MAX_TENSOR_BYTES, MAX_CHUNKS + 1, 2**64,
])
LEAF = (
    st.none() | st.booleans() | EDGE_INTS | st.integers(-(2**63), 2**64) | st.floats(allow_nan=False)
    | st.sampled_from(["array", "packed", "other", "float32", "bfloat16", "int4", "data/1/packed", "data/1/t/0",
                       "data/1/../x", "data/x/y", "/abs", "data/1/" + "k" * MAX_KEY_LEN, ""])
)
VALUE = st.recursive(LEAF, lambda c: st.lists(c, max_size=MAX_NDIM + 2) | st.dictionaries(st.text(max_size=6), c,
                                                                                           max_size=3), max_leaves=6)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _mutated(data: Any, doc: Any) -> Any:
    """A copy of ``doc`` with 1-3 members replaced by drawn values (or, in objects, removed)."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(doc)[1:]))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(VALUE)
    return doc


@FUZZ
@given(data=st.data())
def test_fast_parse_agrees_with_checked_parse(saved, data):
    """Mutated entries: the fast parser declines (None) or gives exactly the checked parser's result."""
    doc, _ = saved
    name = data.draw(st.sampled_from(sorted(doc["tensors"])))
    entry = _mutated(data, doc["tensors"][name])
    fast = _outcome(lambda: TensorEntry._from_json_fast(name, entry, "w", WORLD))
    checked = _outcome(lambda: TensorEntry._from_json_checked(name, entry, "w", WORLD))
    if isinstance(fast, Exception):
        # Only a placement or value range the fast path hands to their own parsers raises.
        assert type(fast) is type(checked) and str(fast) == str(checked)
    elif fast is not None:
        assert _same(fast, checked), (entry, fast, checked)
    full = _outcome(lambda: TensorEntry.from_json(name, entry, "w", WORLD))
    assert type(full) is type(checked) and (
        _same(full, checked) if isinstance(full, TensorEntry) else str(full) == str(checked)
    )


def _agree(name: str, entry: dict[str, Any]) -> None:
    fast = _outcome(lambda: TensorEntry._from_json_fast(name, entry, "w", WORLD))
    checked = _outcome(lambda: TensorEntry._from_json_checked(name, entry, "w", WORLD))
    if isinstance(fast, Exception):
        assert type(fast) is type(checked) and str(fast) == str(checked)
    elif fast is not None:
        assert _same(fast, checked), (entry, checked)


EDGES = [None, True, False, 0.0, 1.5, "x", [], {}, [True], [0.0], [-1], [MAX_EXTENT], [MAX_EXTENT + 1], [1, 1],
         [2**40, 2**40], [0] * (MAX_NDIM + 1), [1] * MAX_NDIM, [0, True], [3.0, 8]]
EDGES += [0, 1, -1, 2, WORLD - 1, WORLD, 255, 256, 1024, MAX_EXTENT, MAX_EXTENT + 1, (1 << 32) - 1, 1 << 32,
          MAX_TENSOR_BYTES - 1, MAX_TENSOR_BYTES, 2**64, "array", "packed", "float32", "int4", "data/1/t/9",
          "data/1/../x", "data/1/" + "k" * MAX_KEY_LEN]


def test_every_field_at_every_edge(saved):
    """Each field of each entry and chunk at each edge value, with nbytes kept consistent
    (as a hostile writer would) and not: both parsers agree."""
    doc, _ = saved
    for name, base in doc["tensors"].items():
        fields = [(f,) for f in ("dtype", "shape", "chunks", "placement", "value_range")]
        fields += [("chunks", 0, f) for f in ("offset", "shape", "key", "rank", "nbytes", "form", "byte_offset",
                                             "crc32", "grid", "value_range")]
        for path in fields:
            for value in EDGES:
                for consistent in (False, True):
                    entry = copy.deepcopy(base)
                    parent = entry
                    for k in path[:-1]:
                        parent = parent[k]
                    parent[path[-1]] = copy.deepcopy(value)
                    c = entry["chunks"][0] if isinstance(entry.get("chunks"), list) and entry["chunks"] else None
                    if consistent and isinstance(c, dict) and isinstance(c.get("shape"), list):
                        if all(type(x) is int for x in c["shape"]) and entry.get("dtype") in ("float32", "int64"):
                            c["nbytes"] = int(np.prod(c["shape"], dtype=object)) * np.dtype(entry["dtype"]).itemsize
                            if isinstance(entry.get("shape"), list) and len(entry["shape"]) != len(c["shape"]):
                                entry["shape"] = [1] * len(c["shape"])
                                c["offset"] = [0] * len(c["shape"])
                    _agree(name, entry)


def test_read_all_mixed_tensors_bit_exact(tmp_path):
    tree = {f"p{i}": np.full((i % 7,), i, np.float32) for i in range(50)}  # (0,)-shaped ones too
    tree["scalar"] = np.array(7, np.uint8)
    tree["bf"] = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    tree["big"] = np.arange(100_000, dtype=np.int32).reshape(1000, 100)
    tree["odd"] = np.arange(20, dtype=">i4")[::2]  # big-endian, strided
    xckpt.save(tree, str(tmp_path / "c"), pack_threshold=1024)
    sharded = xckpt.Writer(str(tmp_path / "s"))
    sharded.write("t", np.arange(6, dtype=np.float32), global_shape=(10,), offset=(0,))
    sharded.write("t", np.arange(6, 10, dtype=np.float32), global_shape=(10,), offset=(6,))
    sharded.commit()
    got = xckpt.load(str(tmp_path / "c"))
    assert sorted(got) == sorted(tree)
    for n, a in tree.items():
        assert got[n].dtype == a.dtype.newbyteorder("=") and got[n].shape == a.shape, n
        assert got[n].tobytes() == a.astype(a.dtype.newbyteorder("=")).tobytes(), n  # bit-exact, C order
    assert np.array_equal(xckpt.load(str(tmp_path / "s"))["t"], np.arange(10, dtype=np.float32))


def test_read_all_of_a_missing_name_names_it(tmp_path):
    xckpt.save({"a": np.ones(3, np.float32)}, str(tmp_path / "c"))
    with xckpt.open(str(tmp_path / "c")) as src:
        with pytest.raises(MissingEntryError, match=r"has no tensor 'b'.*holds 1 tensor\b"):
            src.read_all(["a", "b"])
        assert np.array_equal(src.read_all(["a"])["a"], np.ones(3, np.float32))


# -- packed rows (version 4) ---------------------------------------------------------


def test_whole_packed_tensors_are_written_as_rows(rows):
    doc, m = rows
    assert doc["version"] >= 4 and doc["packed"] == {"1": m.tensors["small"].chunks[0].key}
    assert doc["tensors"]["small"] == ["float32", [256], 1, 0, m.tensors["small"].chunks[0].crc32]
    assert doc["tensors"]["scalar"][:4] == ["int64", [], 1, 1028]  # after small's 1,024 bytes and their crc32
    assert isinstance(doc["tensors"]["big"], dict) and "table" not in doc  # (a chunk table only leads: order kept)
    parsed = Manifest.from_json(doc, "r")
    assert list(parsed.tensors) == ["small", "scalar", "bf", "big"]  # save order kept
    assert _same(dict(parsed.tensors), dict(m.tensors))  # rows parse to the writer's dataclasses


def _row_outcome(name: str, row: Any) -> Any:
    """A mutated row parsed inside a real manifest, and the same tensor as an entry object."""
    doc = {"format": "xckpt", "version": 4, "save_id": "s", "world_size": WORLD, "rank": 1,
           "storage": {"1": "files"}, "packed": {"1": "data/1/packed"}, "tensors": {name: row}, "objects": []}
    return _outcome(lambda: Manifest.from_json(doc, "r").tensors[name])


def _as_entry(row: Any) -> dict[str, Any] | None:
    """The entry-object form of a row (None when the row is not a list of 5)."""
    if not isinstance(row, list) or len(row) != 5:
        return None
    dtype, shape, rank, bo, crc = row
    nbytes = None
    if dtype in ("float32", "int64", "bfloat16") and isinstance(shape, list) and all(type(x) is int for x in shape):
        nbytes = int(np.prod(shape, dtype=object)) * (2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)
    return {"dtype": dtype, "shape": shape, "chunks": [{
        "offset": [0] * len(shape) if isinstance(shape, list) else shape, "shape": shape, "key": "data/1/packed",
        "rank": rank, "nbytes": nbytes, "form": "packed", "byte_offset": bo, "crc32": crc}]}


def _check_row(name: str, row: Any) -> None:
    got = _row_outcome(name, row)
    assert isinstance(got, (TensorEntry, ManifestError)), (row, got)  # never a raw error
    if isinstance(got, ManifestError):
        assert f"tensor {name!r}" in str(got) or "packed" in str(got), str(got)
        return
    entry = _as_entry(row)
    assert entry is not None and got.nbytes > 0, row
    assert _same(got, TensorEntry.from_json(name, entry, "r", WORLD)), row  # what the entry form says


ROW_EDGES = [None, True, False, 0.0, 1.5, "x", [], {}, [True], [0.0], [-1], [0], [MAX_EXTENT], [MAX_EXTENT + 1],
             [2**40, 2**40], [0] * (MAX_NDIM + 1), [1] * MAX_NDIM, 0, 1, -1, 2, WORLD, (1 << 32) - 1, 1 << 32,
             MAX_TENSOR_BYTES - 1, MAX_TENSOR_BYTES, 2**64, "float32", "bfloat16", "int4", "data/1/packed"]


def test_every_row_field_at_every_edge(rows):
    """Each of a row's five fields at each edge value: an entry equal to the entry-object
    form's, or a ManifestError naming the tensor; never a raw error."""
    doc, _ = rows
    for name in ("small", "scalar", "bf"):
        for i in range(5):
            for value in ROW_EDGES:
                row = copy.deepcopy(doc["tensors"][name])
                row[i] = copy.deepcopy(value)
                _check_row(name, row)
        for row in ([], doc["tensors"][name][:4], [*doc["tensors"][name], 0], "row"):
            _check_row(name, row)


@FUZZ
@given(data=st.data())
def test_mutated_rows_parse_or_fail_cleanly(rows, data):
    doc, _ = rows
    name = data.draw(st.sampled_from(["small", "scalar", "bf"]))
    row = _mutated(data, doc["tensors"][name])
    _check_row(name, row)


def test_row_errors_name_the_tensor_and_the_field(rows):
    doc, _ = rows
    base = doc["tensors"]["small"]
    cases = [
        ([*base[:2], 2, *base[3:]], r"tensor 'small': rank 2 has no packed array"),
        (["float32", [0], *base[2:]], r"tensor 'small': a packed row holds no elements"),
        (["int4", *base[1:]], r"tensor 'small': unknown dtype 'int4'"),
        ([*base[:3], -1, base[4]], r"tensor 'small': byte_offset must be an integer"),
        ([*base[:4], 1 << 32], r"tensor 'small': crc32 must be an integer"),
        (["float32", [1 << 40, 1 << 40], *base[2:]], r"tensor 'small': shape .* claims .* bytes, over the limit"),
        (base[:4], r"tensor 'small': a packed row is \[dtype, shape, rank, byte_offset, crc32\]"),
    ]
    for row, match in cases:
        with pytest.raises(ManifestError, match=match):
            Manifest.from_json({**doc, "tensors": {"small": row}}, "r")


def test_packed_member_is_checked(rows):
    doc, _ = rows
    with pytest.raises(ManifestError, match=r"packed names rank '7', not a rank below 3"):
        Manifest.from_json({**doc, "packed": {"7": "data/7/packed"}}, "r")
    with pytest.raises(ManifestError, match=r"packed array of rank 1: chunk key '\.\./x' is not a relative key"):
        Manifest.from_json({**doc, "packed": {"1": "../x"}}, "r")
    with pytest.raises(ManifestError, match=r"a packed row in a manifest without packed arrays"):
        Manifest.from_json({**doc, "packed": {}}, "r")
    with pytest.raises(ManifestError, match=r"a version 3 manifest has no packed member"):
        Manifest.from_json({**doc, "version": 3}, "r")
    old = {k: v for k, v in doc.items() if k not in ("packed", "table")}
    with pytest.raises(ManifestError, match=r"a packed row in a manifest without packed arrays \(version 3"):
        Manifest.from_json({**old, "version": 3}, "r")


def test_rows_load_through_the_reader_bit_exact(rows, tmp_path):
    tree = {f"p{i}": np.full((1 + i % 5, 3), i, np.float32) for i in range(300)}
    tree["bf"] = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    tree["s"] = np.array(-5, np.int8)
    xckpt.save(tree, str(tmp_path / "c"))
    got = xckpt.load(str(tmp_path / "c"))
    assert list(got) == list(tree)
    for n, a in tree.items():
        assert got[n].dtype == a.dtype and got[n].tobytes() == a.tobytes(), n
