"""Packed rows (format version 4): a tensor whose only chunk is the whole tensor,
packed in its rank's byte array -- the many-small-tensors case -- is written in the
manifest's `"tensors"` as `[dtype, shape, rank, byte_offset, crc32]` instead of
an entry object with a chunk object, and `"packed"` names each rank's byte array.
Encoding, the `"packed"` member's checks, and parsing with every field checked.
Used by [`Manifest`][xckpt.manifest.Manifest]; builds the entries of `_entries`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from xckpt.errors import ManifestError
from xckpt.manifest._checks import (
    DTYPES,
    MAX_ELEMENTS,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    ROWS_VERSION,
    VERSION,
    ZEROS,
    _check_key,
    _dims,
    _int,
    _new,
    _set,
    _shape,
    itemsize_of,
    numpy_dtype,
    shared_shape,
)
from xckpt.manifest._entries import Chunk, TensorEntry


def _tensors_to_json(tensors: Mapping[str, TensorEntry]) -> tuple[dict[str, Any], dict[int, str]]:
    """The `"tensors"` member (rows where an entry fits one) and the `"packed"` keys by rank.

    A row is `[dtype, shape, rank, byte_offset, crc32]`: a tensor without placement
    or value range whose only chunk is the whole tensor, packed in its rank's byte
    array. 20,000 tensors of 256 floats: 1.1 MB of manifest instead of 3.8 MB, and
    a fifth of the time to write and to read."""
    keys: dict[int, str] = {}
    out: dict[str, Any] = {}
    for n, t in tensors.items():
        chunks = t.chunks
        if len(chunks) == 1 and t.placement is None and t.value_range is None:
            c = chunks[0]
            if c.form == "packed" and c.shape == t.shape and c.value_range is None and not any(c.offset):
                if keys.setdefault(c.rank, c.key) == c.key:
                    out[n] = [t.dtype, list(t.shape), c.rank, c.byte_offset, c.crc32]
                    continue
        out[n] = t.to_json()
    return out, keys


def _packed_keys(raw: Any, where: str, world_size: int, version: int) -> dict[int, str]:
    """The `"packed"` member: each writer rank's packed byte array (`{"<rank>": key}`)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > world_size:
        raise ManifestError(f"{where}: packed must be an object with at most one key per rank")
    if raw and version < ROWS_VERSION:
        raise ManifestError(f"{where}: a version {version} manifest has no packed member; the file was edited")
    keys = {}
    for r, k in raw.items():
        if not (r.isascii() and r.isdigit() and len(r) < 8 and int(r) < world_size):
            raise ManifestError(f"{where}: packed names rank {r[:20]!r}, not a rank below {world_size}")
        keys[int(r)] = _check_key(k, f"{where}, packed array of rank {r}")
    return keys


def _tensor_entries(
    raw: Mapping[str, Any], keys: Mapping[int, str], where: str, world_size: int,
    dirs: Mapping[int, str] | None = None, version: int = VERSION,
) -> dict[str, TensorEntry]:
    """The `"tensors"` member parsed: entry objects by [`TensorEntry.from_json`][xckpt.TensorEntry.from_json],
    packed rows here, every field checked (plain type and range tests per row, the
    dtype/shape/rank bounds once per distinct combination; error text only on failure).
    20,000 rows: about 0.03 s. `dirs`: the manifest's data directories, given where grid
    entries may appear (version 5 on); `version`: the manifest's."""
    out: dict[str, TensorEntry] = {}
    seen: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # (dtype, shape, rank) -> checked (shape, offset, key, nbytes)
    new, put = _new, _set
    for n, t in raw.items():
        if type(t) is not list:
            out[n] = TensorEntry.from_json(n, t, where, world_size, dirs, version)
            continue
        v = None
        if len(t) == 5:
            dtype, shp, rank, bo, crc = t
            if (
                type(shp) is list
                and type(rank) is int
                and type(bo) is int
                and type(crc) is int
                and 0 <= bo < MAX_TENSOR_BYTES
                and 0 <= crc < 4294967296
                and all(type(x) is int for x in shp)
                and type(dtype) is str
            ):
                k = (dtype, tuple(shp), rank)
                v = seen.get(k)
                if v is None:
                    v = _row_kind(dtype, shp, rank, keys)
                    if v is not None:
                        seen[k] = v
        if v is None:
            raise _row_error(n, t, keys, where)
        shape, off, key, nbytes = v
        c = new(Chunk)
        put(c, "__dict__", {"offset": off, "shape": shape, "key": key, "rank": rank, "nbytes": nbytes,
                            "form": "packed", "byte_offset": bo, "crc32": crc, "grid": None, "value_range": None})
        e = new(TensorEntry)
        put(e, "__dict__", {"name": n, "dtype": dtype, "shape": shape, "chunks": (c,), "placement": None,
                            "value_range": None})
        out[n] = e
    return out


def _row_kind(dtype: str, shp: list[int], rank: int, keys: Mapping[int, str]) -> tuple[Any, ...] | None:
    """(shape, offset, key, nbytes) of a row's dtype, shape and rank when all are valid, else None."""
    itemsize = itemsize_of(dtype)
    if itemsize is None:
        return None
    shape = _dims(shp)
    key = keys.get(rank)
    if shape is None or key is None:
        return None
    elements = math.prod(shape)
    if not 0 < elements <= MAX_ELEMENTS or elements * itemsize >= MAX_TENSOR_BYTES:
        return None
    shape = shared_shape(shape)
    return shape, ZEROS[len(shape)], key, elements * itemsize


def _row_error(name: str, row: list[Any], keys: Mapping[int, str], where: str) -> ManifestError:
    """What is wrong with a packed row `_row_entry` refused."""
    w = f"{where}, tensor {name!r}"
    if not keys:
        return ManifestError(f"{w}: a packed row in a manifest without packed arrays (version 3 or older, or edited)")
    if len(row) != 5:
        return ManifestError(f"{w}: a packed row is [dtype, shape, rank, byte_offset, crc32], got {row!r}"[:300])
    dtype, shp, rank, bo, crc = row
    if type(dtype) is not str or dtype not in DTYPES:
        return ManifestError(f"{w}: unknown dtype {dtype!r}"[:300])
    try:
        shape = _shape(shp, "shape", w)
        _int(rank, "rank", w, hi=MAX_WORLD_SIZE)
        _int(bo, "byte_offset", w, hi=MAX_TENSOR_BYTES)
        _int(crc, "crc32", w, hi=1 << 32)
    except ManifestError as e:
        return e
    if rank not in keys:
        return ManifestError(f"{w}: rank {rank} has no packed array in this manifest's packed member")
    elements = math.prod(shape)
    if elements == 0:
        return ManifestError(f"{w}: a packed row holds no elements (an empty tensor is an entry with no chunks)")
    return ManifestError(
        f"{w}: shape {list(shape)} ({dtype}) claims {elements * numpy_dtype(dtype).itemsize} bytes, over the "
        f"limit of {MAX_TENSOR_BYTES}; the manifest is corrupt or hostile"
    )
