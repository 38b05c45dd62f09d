"""The manifest's constants and field checks: format versions, fixed bounds on what a manifest may claim, the dtype
table, and plain-type validators (a precise [`ManifestError`][xckpt.errors.ManifestError] each, or a
fast yes/no for the many-small-tensors path). Kept apart from `xckpt.manifest`, which
re-exports the public names, so the model stays readable."""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import numpy as np

from xckpt.errors import ManifestError, ObjectError

FORMAT = "xckpt"
VERSION = 6
#: Versions this xckpt reads (1: no checksum; 2: checksummed manifests; 3: storage "files";
#: 4: packed rows; 5: grid entries and "dirs"; 6: binary grid columns, "codecs", "refs",
#: "hashes" and "deltas").
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
#: The first version with codecs, references to other steps and chunk hashes
#: (see `xckpt.manifest._incremental`).
INCREMENTAL_VERSION = 6
#: The first version whose "tensors" may hold packed rows (see `xckpt.manifest._rows`).
ROWS_VERSION = 4
#: The first version whose entries may be grids (see `xckpt.manifest._grids`).
GRID_VERSION = 5
#: The first version whose grid columns (ranks, packed byte offsets and crc32s) may be base64
#: strings of little-endian integers (see `xckpt.manifest._grids`).
COLUMNS_VERSION = 6
#: The first version whose packed chunks are followed in their packed array by their crc32
#: (4 bytes, little-endian), so a grid's packed cells need not list them (see `xckpt.manifest._grids`).
TRAILER_VERSION = 6
#: The first version whose rank manifests may list single-chunk tensors in a chunk table
#: (columns, see `xckpt.manifest._table`).
TABLE_VERSION = 6
#: How a rank's data/<rank>/ is organised (see xckpt.storage); "files" from version 3.
STORAGE_KINDS = ("files", "plain", "ocdbt")

#: Fixed bounds on what a manifest may claim (checked before anything is sized from it).
MAX_WORLD_SIZE = 1 << 20
MAX_NDIM = 32
MAX_EXTENT = 1 << 62
MAX_ELEMENTS = 1 << 62
MAX_TENSOR_BYTES = 1 << 56
MAX_CHUNKS = 1 << 24
MAX_KEY_LEN = 1024
MAX_NAME_LEN = 1 << 16

#: Every dtype a checkpoint may hold; all round-trip bit-exact.
DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)

_DTYPE_CACHE: dict[str, np.dtype] = {}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a manifest dtype name (ml_dtypes for bf16 and float8)."""
    dt = _DTYPE_CACHE.get(name)
    if dt is None:
        if name not in DTYPES:
            raise ManifestError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
        if name in ("bfloat16",) or name.startswith("float8"):
            import ml_dtypes

            dt = np.dtype(getattr(ml_dtypes, name))
        else:
            dt = np.dtype(name)
        _DTYPE_CACHE[name] = dt
    return dt


_NAME_CACHE: dict[np.dtype, str] = {}


def dtype_name(dtype: Any) -> str:
    """The manifest name of a numpy (or ml_dtypes) dtype."""
    dt = np.dtype(dtype)
    name = _NAME_CACHE.get(dt)  # dtype.name is slow (about 6 us): once per tensor adds up
    if name is None:
        name = dt.name
        if name not in DTYPES:
            raise ObjectError(
                f"dtype {dt} cannot be stored; supported dtypes are {', '.join(DTYPES)}"
            )
        _NAME_CACHE[dt] = name
    return name


_KEY_RE = re.compile(r"^data/[0-9]+(\.[0-9a-f]{1,32})?(/[A-Za-z0-9_.\-]+)+$")


@functools.lru_cache(maxsize=1 << 16)
def _key_ok(key: str) -> bool:
    return bool(_KEY_RE.match(key)) and not any(part in ("", ".", "..") for part in key.split("/"))


def _check_key(key: object, where: str) -> str:
    if type(key) is not str or len(key) > MAX_KEY_LEN or not _key_ok(key):
        if type(key) is str and len(key) > MAX_KEY_LEN:
            key = key[:64] + f"... ({len(key)} characters)"
        raise ManifestError(
            f"{where}: chunk key {key!r} is not a relative key under data/<rank>/; refusing a "
            "key that could leave the checkpoint"
        )
    return key


_INT_TYPES = {int}


def _ints(v: Any, what: str, where: str) -> tuple[int, ...]:
    # set(map(type, ...)) runs in C: manifests of 100k chunks parse in well under a second.
    if type(v) not in (list, tuple) or (v and set(map(type, v)) != _INT_TYPES):
        raise ManifestError(f"{where}: {what} must be a list of integers, got {v!r}")
    return tuple(v)


def _int(v: Any, what: str, where: str, lo: int = 0, hi: int = 1 << 64) -> int:
    if type(v) is not int or not lo <= v < hi:
        shown = repr(v) if len(repr(v)) < 80 else repr(v)[:80] + "..."
        raise ManifestError(f"{where}: {what} must be an integer in [{lo}, {hi}), got {shown}")
    return v


def _str(v: Any, what: str, where: str, limit: int = MAX_NAME_LEN) -> str:
    if type(v) is not str or len(v) > limit:
        shown = repr(v)[:80]
        raise ManifestError(f"{where}: {what} must be a string of at most {limit} characters, got {shown}")
    return v


def _shape(v: Any, what: str, where: str) -> tuple[int, ...]:
    """A shape (or offset): at most MAX_NDIM non-negative extents of at most MAX_EXTENT."""
    shp = _ints(v, what, where)
    if len(shp) > MAX_NDIM or (shp and (min(shp) < 0 or max(shp) > MAX_EXTENT)):
        raise ManifestError(
            f"{where}: {what} {list(shp)[:8]} must have at most {MAX_NDIM} dimensions, each in [0, 2**62]"
        )
    return shp


# ---------------------------------------------------------------------------
# Fast paths for manifests of many small tensors.
#
# A frozen dataclass's generated `__init__` sets each field through
# `object.__setattr__`: 3 us for a Chunk, a third of a 20,000-tensor load.
# Values that are already validated (the fast parser below, the writer) build
# instances by installing a complete field dict instead (about 1 us).

_new = object.__new__
_set = object.__setattr__
_T = TypeVar("_T")


def unchecked(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass `cls` from a dict naming every field, in
    field order (no checks, no copy: `fields` becomes the instance's `__dict__`)."""
    obj = _new(cls)
    _set(obj, "__dict__", fields)
    return obj


_build = unchecked


def _dims(v: Any) -> tuple[int, ...] | None:
    """`v` as a shape when it plainly is one (what `_shape` accepts from JSON), else None."""
    if type(v) is not list or len(v) > MAX_NDIM:
        return None
    for x in v:
        if type(x) is not int or not 0 <= x <= MAX_EXTENT:
            return None
    return tuple(v)


_ITEMSIZES: dict[str, int] = {}


def itemsize_of(dtype: str) -> int | None:
    """Bytes per element of a dtype name, or None when it is not one of `DTYPES` (cached)."""
    itemsize = _ITEMSIZES.get(dtype)
    if itemsize is None:
        if dtype not in DTYPES:
            return None
        itemsize = _ITEMSIZES[dtype] = numpy_dtype(dtype).itemsize
    return itemsize


#: The all-zero offset of each rank: most chunks start at the origin and share it.
ZEROS = tuple((0,) * n for n in range(MAX_NDIM + 1))
#: Tensor shapes seen (bounded): the 20,000 tensors of a model share a few dozen shapes.
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}


def shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` (a tuple of ints), or an equal tuple seen before: the tensors of one shape
    share one tuple (less to allocate, less for the garbage collector to walk)."""
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
    return _SHAPES.setdefault(shape, shape)
