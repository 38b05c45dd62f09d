"""Every decoder of untrusted manifest bytes ends in an XckptError or a valid result.

Hypothesis drives mutated real manifests (byte-level, and structural with the checksum
recomputed as a hostile writer would), random JSON documents, object values with
malformed tags, value-range annotations and placements of the wrong types. The
reproductions of issue 13 (huge claims, deep nesting, quadratic layouts) are checked
for their error and for bounded time.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import (
    CorruptChunkError,
    FormatVersionError,
    IncompleteCheckpointError,
    LayoutError,
    ManifestError,
    XckptError,
)
from xckpt.manifest import (
    Manifest,
    PlacementInfo,
    ValueRange,
    decode_value,
    encode_value,
    manifest_bytes,
    merge_manifests,
    parse_document,
    parse_header,
    signed,
    signed_header,
)
from xckpt.native._zarr import NativeStorage as Storage
from xckpt.native.commit import read_rank_manifests, validate

SOAK = os.environ.get("XCKPT_SOAK", "") not in ("", "0")
FUZZ = settings(
    max_examples=1500 if SOAK else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def _real_manifest(root: str) -> bytes:
    """Rank 0's manifest of a save with packed and array chunks, placement, value range, objects."""
    w = xckpt.Writer(root, rank=0, world_size=2, save_id="fuzz")
    w.write("w", np.ones((300, 300), np.float32)[:150], global_shape=(300, 300), offset=(0, 0),
            placement=PlacementInfo(framework="torch", mesh_shape=(2,), axis_names=("dp",), placements=("Shard(0)",)))
    w.write("b", np.arange(8, dtype=np.int64),
            value_range=ValueRange(group="g", role="key", kind="generic", domain=(0, 8), empty_marker=-1,
                                   attrs={"members": {}, "input_bounds": [0, 8]}),
            chunk_value_range=(0, 8))
    w.write_object("cfg", {"lr": 0.5, "t": (1, 2), 3: b"x", "f": float("inf"), "big": 2**70})
    w.write_object("blob", bytes(range(256)) * 20)
    w.commit()
    with open(os.path.join(root, "ranks", "0.json"), "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> bytes:
    return _real_manifest(str(tmp_path_factory.mktemp("fuzz") / "c"))


def _decode(data: bytes) -> None:
    """Everything a reader does with one manifest's bytes before touching chunk data."""
    try:
        m = Manifest.loads(data, "fuzz/ranks/0.json")
        validate(m, "fuzz")
        for o in m.objects:
            if o.kind == "json":
                decode_value(o.value, "fuzz")
        merge_manifests([m], "fuzz")
    except XckptError:
        pass


def test_real_manifest_round_trips(real):
    m = Manifest.loads(real, "r")
    assert Manifest.loads(m.dumps(), "r").to_json() == m.to_json()


@FUZZ
@given(data=st.data())
def test_byte_mutations_of_a_real_manifest(real, data):
    raw = bytearray(real)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del raw[pos : pos + data.draw(st.integers(1, 8))]
        else:
            del raw[pos:]
        if not raw:
            raw = bytearray(b"{")
    if bytes(raw) != real:
        with pytest.raises(XckptError):
            Manifest.loads(bytes(raw), "fuzz/ranks/0.json")  # the checksum catches every change
        assert not signed(bytes(raw))  # so does the bytes-only check (a replica's manifest on arrival)
        assert signed_header(bytes(raw), "fuzz") is None  # and the header-only read (a local tier's listing)
    assert signed(real)


def test_signed_header_is_the_header_of_the_whole_parse(real):
    head = signed_header(real, "r")
    full = parse_header(parse_document(real, "r"), "r")
    assert head is not None
    assert head._replace(tensors={}, objects=[]) == full._replace(tensors={}, objects=[])
    assert head.tensors == {} and head.objects == []
    unsigned = real[: real.rindex(b',"checksum"')] + b"}"
    assert signed_header(unsigned, "r") is None  # no checksum: the whole parse says why


def test_signed_header_checks_the_header(real):
    doc = json.loads(real)
    doc["world_size"] = 0
    with pytest.raises(ManifestError, match="world_size"):
        signed_header(manifest_bytes(doc), "tier/3/ranks/0.json")
    doc = json.loads(real)
    doc["format"] = "other"
    with pytest.raises(FormatVersionError, match="not an xckpt manifest"):
        signed_header(manifest_bytes(doc), "tier/3/ranks/0.json")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@FUZZ
@given(data=st.data())
def test_structural_mutations_with_checksum_recomputed(real, data):
    """A hostile writer: any field replaced or removed, checksum valid. An XckptError or a manifest."""
    doc = json.loads(real)
    del doc["checksum"]
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = data.draw(st.sampled_from(paths))
        delete = bool(path) and data.draw(st.booleans())
        doc = _set(doc, path, data.draw(JSON), delete)
    if isinstance(doc, dict):
        _decode(manifest_bytes(doc))
    else:
        _decode(json.dumps(doc).encode())


@FUZZ
@given(doc=st.dictionaries(st.sampled_from(["format", "version", "save_id", "world_size", "rank", "storage",
                                            "tensors", "objects", "metadata", "x"]), JSON, max_size=9))
def test_random_json_documents(doc):
    doc = {"format": "xckpt", "version": 2, **doc}
    _decode(manifest_bytes(doc))


TAGS = ["tuple", "bytes", "dict", "float", "int", "np", "other", 3, None]
TAGGED = st.recursive(
    JSON,
    lambda c: st.fixed_dictionaries(
        {"$xckpt": st.sampled_from(TAGS)},
        optional={"items": c | st.lists(st.lists(c, max_size=3), max_size=3), "b64": c | st.text(max_size=12),
                  "v": c, "dtype": st.sampled_from(["float32", "int8", "bool", "object", "bfloat16"]) | c},
    ) | st.lists(c, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(value=TAGGED)
def test_object_values_decode_or_raise(value):
    try:
        decode_value(value, "fuzz")
    except ManifestError:
        pass


@FUZZ
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.tuples(c, c) | st.dictionaries(st.integers() | st.text(max_size=3), c,
                                                                             max_size=3),
    max_leaves=20,
))
def test_object_values_round_trip(value):
    got = decode_value(json.loads(json.dumps(encode_value(value))))
    assert repr(got) == repr(value) or (got != got and value != value)


@FUZZ
@given(d=st.dictionaries(st.sampled_from(["group", "role", "kind", "domain", "empty_marker", "attrs"]), JSON,
                         max_size=6))
def test_value_range_annotations(d):
    try:
        ValueRange.from_json(d, "fuzz")
    except ManifestError:
        pass


@FUZZ
@given(d=st.dictionaries(st.sampled_from(["framework", "mesh_shape", "axis_names", "placements", "partition_spec",
                                          "layout"]), JSON, max_size=6))
def test_placements_of_any_type(d):
    try:
        PlacementInfo.from_json(d, "fuzz")
    except ManifestError:
        pass


@FUZZ
@given(ranks=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.sampled_from(["a", "b"]),
                                st.booleans()), min_size=1, max_size=5))
def test_rank_manifest_sets(real, ranks):
    """Any set of rank manifests and claims: a merged checkpoint or an XckptError."""
    import uuid

    st_ = Storage(f"memory://fuzz-{uuid.uuid4().hex}/")
    base = json.loads(real)
    for r, world, sid, claim in ranks:
        if claim:
            from xckpt.manifest import Claim, claim_bytes

            data = claim_bytes(Claim(save_id=sid, rank=r, world_size=world, token=""))
        else:
            doc = {**base, "rank": r, "world_size": world, "save_id": sid}
            doc["storage"] = {str(r): "ocdbt"} if r < world else {}
            doc["tensors"] = {} if r else doc["tensors"]
            doc["objects"] = []
            doc.pop("checksum")
            data = manifest_bytes(doc)
        st_.write_key(f"ranks/{r}.json", data)
    try:
        read_rank_manifests(st_)
    except XckptError:
        pass


# -- issue 13 reproductions: bounded before allocation ---------------------------------------


def _hostile_bytes(d: dict) -> bytes:
    """A manifest with a valid checksum written by another JSON encoder (no depth limit)."""
    import hashlib

    body = json.dumps({k: v for k, v in d.items() if k != "checksum"}, separators=(",", ":")).encode()
    body = body.replace(b'"__DEEP__"', b"[" * 1000 + b"1" + b"]" * 1000)  # deeper than json can write
    return body[:-1] + b',"checksum":"sha256:' + hashlib.sha256(body).hexdigest().encode() + b'"}'


def _as_entries(d: dict) -> None:
    """Rewrite version 4's packed rows as the entry objects they stand for (both forms are read)."""
    from xckpt.manifest import numpy_dtype

    for n, t in d["tensors"].items():
        if isinstance(t, list):
            dtype, shape, rank, bo, crc = t
            chunk = {"offset": [0] * len(shape), "shape": shape, "key": d["packed"][str(rank)], "rank": rank,
                     "nbytes": int(np.prod(shape)) * numpy_dtype(dtype).itemsize, "form": "packed",
                     "byte_offset": bo, "crc32": crc}
            d["tensors"][n] = {"dtype": dtype, "shape": shape, "chunks": [chunk]}


def _edit(root: str, fn, entries: bool = True) -> None:
    p = os.path.join(root, "xckpt.json")
    d = orjson.loads(open(p, "rb").read())
    if entries:
        _as_entries(d)
    fn(d)
    with open(p, "wb") as f:
        f.write(_hostile_bytes(d))


def test_huge_claims_are_refused_before_allocation(tmp_path):
    root = str(tmp_path / "c")
    xckpt.save({"small": np.arange(16, dtype=np.uint8), "big": np.ones((300, 300), np.float32) * 3}, root)

    def claim(name, shape):
        def fn(d):
            t = d["tensors"][name]
            t["shape"] = list(shape)
            t["chunks"][0]["shape"] = list(shape)
            t["chunks"][0]["nbytes"] = int(np.prod(shape)) * (4 if name == "big" else 1)
        return fn

    _edit(root, claim("small", (2**62,)))
    with pytest.raises(ManifestError, match=r"tensor 'small': shape \[4611686018427387904\].*over the limit"):
        xckpt.open(root)
    _edit(root, claim("small", (2**40,)))  # within the fixed bound, beyond what storage holds
    with pytest.raises(CorruptChunkError, match=r"tensor 'small'.*claims bytes \[0, 1099511627776\).*holds 20 bytes"):
        xckpt.load(root)
    _edit(root, claim("small", (16,)))
    _edit(root, claim("big", (2**20, 2**16)))
    with pytest.raises(CorruptChunkError, match=r"tensor 'big'.*does not match the manifest"):
        xckpt.open(root).read("big")
    _edit(root, lambda d: d.update(world_size=2**62))
    with pytest.raises(ManifestError, match=r"world_size must be an integer in \[1, 1048577\)"):
        xckpt.open(root)


def test_huge_claims_in_packed_rows_are_refused_before_allocation(tmp_path):
    root = str(tmp_path / "c")
    xckpt.save({"small": np.arange(16, dtype=np.uint8)}, root)
    _edit(root, lambda d: d["tensors"]["small"].__setitem__(1, [2**62]), entries=False)
    with pytest.raises(ManifestError, match=r"tensor 'small': shape \[4611686018427387904\].*over the limit"):
        xckpt.open(root)
    _edit(root, lambda d: d["tensors"]["small"].__setitem__(1, [2**40]), entries=False)
    with pytest.raises(CorruptChunkError, match=r"tensor 'small'.*claims bytes \[0, 1099511627776\).*holds 20 bytes"):
        xckpt.load(root)


def test_huge_world_size_in_rank_manifests_costs_nothing(tmp_path):
    root = str(tmp_path / "c")
    w = xckpt.Writer(root, rank=0, world_size=2**20, save_id="s")
    w.write("t", np.ones(4), global_shape=(4 * 2**20,), offset=(0,))
    t = time.perf_counter()
    w.commit()
    with pytest.raises(IncompleteCheckpointError, match=r"rank manifests missing: \[1, 2, .*\(1048575 ranks\)\]"):
        xckpt.open(root)
    assert time.perf_counter() - t < 5


def test_long_chunk_key_is_refused_quickly(tmp_path):
    root = str(tmp_path / "c")
    xckpt.save({"big": np.ones((300, 300), np.float32)}, root)
    _edit(root, lambda d: d["tensors"]["big"]["chunks"][0].update(key="data/0/" + "a" * 50_000_000))
    t = time.perf_counter()
    with pytest.raises(ManifestError, match=r"chunk key 'data/0/aaa.*\(50000007 characters\)"):
        xckpt.open(root)
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("n", [3000, 4000])
def test_many_column_chunks_open_quickly(tmp_path, n):
    """A [1, n] tensor in n column chunks (quadratic before: 39 s for 3,000)."""
    root = str(tmp_path / "c")
    w = xckpt.Writer(root)
    full = np.arange(n, dtype=np.float32).reshape(1, n)
    for j in range(n):
        w.write("t", full[:, j : j + 1], global_shape=(1, n), offset=(0, j))
    w.commit()
    t = time.perf_counter()
    ck = xckpt.open(root)
    assert time.perf_counter() - t < 3
    assert ck.read("t").tobytes() == full.tobytes()
    _edit(root, lambda d: d["tensors"]["t"]["chunks"][5].update(offset=[0, 4]))
    t = time.perf_counter()
    with pytest.raises(LayoutError, match=r"chunks \[0:1, 4:5\] and \[0:1, 4:5\] overlap"):
        xckpt.open(root)
    assert time.perf_counter() - t < 3


def test_hostile_objects_and_annotations(tmp_path):
    root = str(tmp_path / "c")
    xckpt.save({"b": np.arange(3), "o": 1}, root)
    cases = [
        ("__DEEP__", r"object 'o': the value is nested more than 200 levels deep"),
        ({"$xckpt": "dict", "items": 5}, r"object 'o': malformed 'dict' value"),
        ({"$xckpt": "dict", "items": [[[1, {"a": 1}], 2]]}, r"malformed 'dict' value"),
        ({"$xckpt": "bytes", "b64": "@@@"}, r"malformed 'bytes' value"),
        ({"$xckpt": "np", "dtype": "float32", "v": "x"}, r"malformed 'np' value"),
        ({"$xckpt": "np", "dtype": "object", "v": 1}, r"malformed 'np' value"),
        ({"$xckpt": "int", "v": "1" * 5000}, r"malformed 'int' value"),
        ({"$xckpt": 3}, r"unknown object tag 3"),
    ]
    for value, msg in cases:
        _edit(root, lambda d, value=value: d["objects"][0].update(value=value))
        with pytest.raises(ManifestError, match=msg):
            xckpt.open(root)
    _edit(root, lambda d: d["objects"][0].update(value=1))
    vr = {"group": "g", "role": "key", "empty_marker": "abc"}
    _edit(root, lambda d: d["tensors"]["b"].update(value_range=vr))
    with pytest.raises(ManifestError, match=r"tensor 'b', value_range: empty_marker must be a 64-bit integer"):
        xckpt.open(root)
    _edit(root, lambda d: d["tensors"]["b"].pop("value_range"))
    for pl, msg in [
        ({"framework": "torch", "mesh_shape": "x"}, r"placement: mesh_shape must be a list of integers"),
        ({"framework": "torch", "mesh_shape": [2], "placements": 5}, r"placements must be a list"),
        ({"framework": "jax", "mesh_shape": [2], "partition_spec": [[1]]}, r"partition_spec entry must be"),
    ]:
        _edit(root, lambda d, pl=pl: d["tensors"]["b"].update(placement=pl))
        with pytest.raises(ManifestError, match=msg):
            xckpt.open(root)


def test_odd_rank_manifest_keys_are_ignored(real):
    """Keys under ranks/ that are not ranks/<ASCII digits>.json are not rank manifests."""
    import uuid

    st_ = Storage(f"memory://fuzz-{uuid.uuid4().hex}/")
    doc = {**json.loads(real), "world_size": 1, "storage": {"0": "ocdbt"}, "objects": []}
    doc["tensors"] = {}
    st_.write_key("ranks/0.json", manifest_bytes(doc))
    for key in ("ranks/\u00b2.json", "ranks/0000000000001.json", "ranks/-1.json", "ranks/1.json.tmp"):
        st_.write_key(key, b"{")
    assert read_rank_manifests(st_).world_size == 1


def test_saving_a_too_deep_or_self_referencing_object_is_an_object_error(tmp_path):
    from xckpt.errors import ObjectError

    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    loop: list = []
    loop.append(loop)
    for value in (deep, loop):
        with pytest.raises(ObjectError, match=r"object 'o' is nested more than 200 levels deep \(or contains itself\)"):
            xckpt.save({"o": value}, str(tmp_path / "c"))
        assert not (tmp_path / "c" / "ranks" / "0.json").exists()
