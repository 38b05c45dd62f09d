"""A tensor's stored box and where its bytes live (`Chunk`), with its JSON form.

A chunk is `{"offset", "shape", "key", "rank", "nbytes"}` plus `"grid"` (the
zarr chunk shape inside an array chunk) or, for a chunk packed into its rank's byte
array, `"form": "packed", "byte_offset", "crc32"`; `"value_range"` for value
groups. Validated on read (`Chunk.from_json`, or all at once for a list of
plain chunks, `_chunks_fast`). Used by `_entries` and `_grids`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from xckpt.errors import ManifestError
from xckpt.layout import Box
from xckpt.manifest._checks import (
    MAX_EXTENT,
    MAX_KEY_LEN,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    ZEROS,
    _check_key,
    _dims,
    _int,
    _ints,
    _key_ok,
    _new,
    _set,
    _shape,
)

__all__ = ["Chunk", "RawFields", "raw_chunk_fields"]


#: A raw chunk's fields, each checked: offset, shape (lists), rank, nbytes, form, inner grid,
#: packed byte offset and crc32 (None for an array chunk), value range.
RawFields = tuple[list[int], list[int], int, int, str, "tuple[int, ...] | None", "int | None", "int | None", Any]


def raw_chunk_fields(d: Any, ndim: int, itemsize: int, world_size: int) -> RawFields | None:
    """The fields of one raw chunk (a JSON object as the writer writes it) when every one
    passes every check of `Chunk.from_json` except the key's; None when any might not (the
    checked path then raises the precise error). The one fast check of a chunk, for entries
    and for rank manifests merged as columns."""
    if type(d) is not dict:
        return None
    get = d.get
    off, shp, rank, nbytes = get("offset"), get("shape"), get("rank"), get("nbytes")
    if (
        type(off) is not list
        or type(shp) is not list
        or len(off) != ndim
        or len(shp) != ndim
        or type(rank) is not int
        or not 0 <= rank < world_size
        or type(nbytes) is not int
        or nbytes >= MAX_TENSOR_BYTES
    ):
        return None
    for x in off:
        if type(x) is not int or not 0 <= x <= MAX_EXTENT:
            return None
    for x in shp:
        if type(x) is not int or not 0 <= x <= MAX_EXTENT:
            return None
    if nbytes != math.prod(shp) * itemsize:
        return None
    form = get("form", "array")
    grid = bo = crc = None
    if form == "packed":
        bo, crc = get("byte_offset"), get("crc32")
        if type(bo) is not int or not 0 <= bo < MAX_TENSOR_BYTES or type(crc) is not int or not 0 <= crc < 1 << 32:
            return None
    elif form == "array":
        raw_grid = get("grid")
        if raw_grid is not None:
            grid = _dims(raw_grid)
            if grid is None or len(grid) != ndim or (grid and min(grid) < 1):
                return None
    else:
        return None
    vr = get("value_range")
    if vr is not None:
        if type(vr) is not list or len(vr) != 2 or type(vr[0]) is not int or type(vr[1]) is not int:
            return None
        vr = tuple(vr)
    return off, shp, rank, nbytes, form, grid, bo, crc, vr


def _chunks_fast(raw: list[Any], shape: tuple[int, ...], itemsize: int, world_size: int) -> tuple[Chunk, ...] | None:
    """The chunks of a tensor entry when every one passes every check of
    `Chunk.from_json` and `TensorEntry.from_json`; None when any might
    not (the checked path then raises the precise error)."""
    ndim = len(shape)
    zeros = ZEROS[ndim]
    out = []
    for d in raw:
        fields = raw_chunk_fields(d, ndim, itemsize, world_size)
        if fields is None:
            return None
        off_l, shp_l, rank, nbytes, form, grid, bo, crc, vr = fields
        key = d.get("key")
        if type(key) is not str or len(key) > MAX_KEY_LEN or not _key_ok(key):
            return None
        off, shp = tuple(off_l), tuple(shp_l)
        # Shared tuples (a whole-tensor chunk's shape is the tensor's): fewer objects to
        # allocate, and fewer for the garbage collector to walk once the manifest is built.
        if off == zeros:
            off = zeros
        if shp == shape:
            shp = shape
        c = _new(Chunk)
        _set(
            c,
            "__dict__",
            {
                "offset": off,
                "shape": shp,
                "key": key,
                "rank": rank,
                "nbytes": nbytes,
                "form": form,
                "byte_offset": bo,
                "crc32": crc,
                "grid": grid,
                "value_range": vr,
            },
        )
        out.append(c)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One stored box of a tensor and where its bytes live."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    key: str
    rank: int
    nbytes: int
    form: str = "array"  # "array": its own zarr v3 array; "packed": bytes of data/<rank>/packed
    byte_offset: int | None = None
    crc32: int | None = None
    grid: tuple[int, ...] | None = None  # zarr chunk shape inside an "array" chunk
    value_range: tuple[int, int] | None = None

    @functools.cached_property
    def box(self) -> Box:
        return Box(self.offset, self.shape)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "offset": list(self.offset),
            "shape": list(self.shape),
            "key": self.key,
            "rank": self.rank,
            "nbytes": self.nbytes,
        }
        if self.grid is not None:
            d["grid"] = list(self.grid)
        if self.form != "array":
            d["form"] = self.form
            d["byte_offset"] = self.byte_offset
            d["crc32"] = self.crc32
        if self.value_range is not None:
            d["value_range"] = list(self.value_range)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> Chunk:
        """A chunk from its manifest JSON, every malformed field a
        [`ManifestError`][xckpt.errors.ManifestError] naming `where` (never a raw `TypeError`)."""
        try:
            return cls._from_json(d, where)
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"{where}: malformed chunk ({type(e).__name__}: {e})"[:400]) from None

    @classmethod
    def _from_json(cls, d: Any, where: str) -> Chunk:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: a chunk must be an object, got {d!r}")
        try:
            offset = _shape(d["offset"], "offset", where)
            shape = _shape(d["shape"], "shape", where)
            form = d.get("form", "array")
            if form not in ("array", "packed"):
                raise ManifestError(f"{where}: unknown chunk form {form!r}")
            vr = d.get("value_range")
            raw_grid = d.get("grid")
            key = _check_key(d["key"], where)
            rank = _int(d["rank"], "rank", where, hi=MAX_WORLD_SIZE)
            nbytes = _int(d["nbytes"], "nbytes", where, hi=MAX_TENSOR_BYTES)
            byte_offset = (
                None if form == "array" else _int(d["byte_offset"], "byte_offset", where, hi=MAX_TENSOR_BYTES)
            )
            crc32 = None if form == "array" else _int(d["crc32"], "crc32", where, hi=1 << 32)
            grid = (None if raw_grid is None else _shape(raw_grid, "grid", where)) if form == "array" else None
            value_range = None if vr is None else _ints(vr, "value_range", where)
        except KeyError as e:
            raise ManifestError(f"{where}: chunk lacks field {e.args[0]!r}") from None
        if len(offset) != len(shape) or any(x < 0 for x in offset + shape):
            raise ManifestError(f"{where}: chunk offset {offset} / shape {shape} is invalid")
        if grid is not None and (len(grid) != len(shape) or any(g < 1 for g in grid)):
            raise ManifestError(f"{where}: chunk grid {grid} does not fit shape {shape}")
        if value_range is not None and len(value_range) != 2:
            raise ManifestError(f"{where}: value_range must be [lo, hi)")
        return cls(
            offset=offset,
            shape=shape,
            key=key,
            rank=rank,
            nbytes=nbytes,
            form=form,
            byte_offset=byte_offset,
            crc32=crc32,
            grid=grid,
            value_range=value_range,
        )


