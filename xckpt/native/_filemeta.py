"""The metadata of the arrays `xckpt.native._fileio` reads and writes itself: file names,
`zarr.json` (as tensorstore writes it), and the checks of a manifest's claims against them.
Split from `xckpt.native._fileio` so each stays one job (I/O here is a `stat` and
small `zarr.json` reads)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from xckpt.errors import ManifestError
from xckpt.manifest import numpy_dtype
from xckpt.native import _codecs
from xckpt.native._zarr import CODECS, CODECS_1, array_metadata

__all__ = [
    "ChunkFileError", "chunk_file", "data_file", "grid_ranges", "zarr_json", "stored_meta", "parse_layout",
    "parse_meta", "check_meta", "check_shard",
]


class ChunkFileError(ValueError):
    """A chunk file is missing, has the wrong size or fails its crc32c (the data is damaged)."""


def chunk_file(key_dir: str, idx: Sequence[int]) -> str:
    """The file of zarr chunk `idx` of a "plain" array in `key_dir`."""
    return os.path.join(key_dir, "c", *map(str, idx)) if idx else os.path.join(key_dir, "c")


def data_file(key_dir: str, ndim: int) -> str:
    """The shard file of a "files" array in `key_dir`."""
    return os.path.join(key_dir, "c." + ".".join(["0"] * ndim)) if ndim else os.path.join(key_dir, "c")


def grid_ranges(shape: Sequence[int], grid: Sequence[int]) -> list[range]:
    return [range(-(-s // g)) for s, g in zip(shape, grid)]


def zarr_json(kind: str, dtype: str, shape: Sequence[int], grid: Sequence[int], codec: str | None = None) -> bytes:
    return json.dumps(array_metadata(kind, dtype, shape, grid, codec), separators=(",", ":")).encode()


def stored_meta(root: str, key: str) -> dict[str, Any]:
    """The `zarr.json` of the array at `key` (ChunkFileError when missing or unreadable)."""
    path = os.path.join(root, key, "zarr.json")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        raise ChunkFileError(f"{path} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChunkFileError(f"{path} is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ChunkFileError(f"{path} is not a JSON object")
    return meta


def _chain(codecs: Any, dtype: str) -> str | None | bool:
    """The compression of a zarr chunk's codec chain (bytes, optional codec, crc32c); False
    for a chain this module does not read."""
    if codecs in (CODECS, CODECS_1):
        return None
    if not (isinstance(codecs, list) and len(codecs) == 3 and [codecs[0], codecs[2]] in (CODECS, CODECS_1)):
        return False
    try:
        itemsize = numpy_dtype(dtype).itemsize
    except (ManifestError, TypeError):
        return False
    found = _codecs.compression_of(codecs[1:2], itemsize)
    return found if found else False


def parse_layout(meta: dict[str, Any]) -> tuple[str, str, list[int], list[int], str | None] | None:
    """`(kind, dtype, shape, grid, codec)` of stored metadata this module reads, else None."""
    try:
        codecs = meta["codecs"]
        shape = list(meta["shape"])
        outer = list(meta["chunk_grid"]["configuration"]["chunk_shape"])
        dtype = meta["data_type"]
        if meta["chunk_grid"]["name"] != "regular" or not isinstance(dtype, str):
            return None
        codec = _chain(codecs, dtype)
        if codec is not False:
            kind, grid = "plain", outer
        elif (
            len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed"
            and codecs[0]["configuration"].get("index_location") == "start"
            and codecs[0]["configuration"]["index_codecs"] == CODECS
        ):
            codec = _chain(codecs[0]["configuration"]["codecs"], dtype)
            kind, grid = "files", list(codecs[0]["configuration"]["chunk_shape"])
        if codec is False:
            return None
    except (KeyError, TypeError, AttributeError, IndexError):
        return None
    if not all(type(v) is int and v >= 0 for v in shape + grid) or len(grid) != len(shape) or 0 in grid:
        return None
    if array_metadata(kind, dtype, shape, grid)["chunk_grid"]["configuration"]["chunk_shape"] != outer:
        return None  # a "files" array of several shards, or keys this module does not name
    if meta.get("chunk_key_encoding") != array_metadata(kind, dtype, shape, grid)["chunk_key_encoding"]:
        return None
    return kind, dtype, shape, grid, codec  # type: ignore[return-value]


def parse_meta(meta: dict[str, Any]) -> tuple[str, str, list[int], list[int]] | None:
    """`(kind, dtype, shape, grid)` of stored metadata of an uncompressed array this module
    reads, else None."""
    got = parse_layout(meta)
    return None if got is None or got[4] is not None else got[:4]


def check_meta(
    root: str, key: str, kind: str, dtype: str, shape: Sequence[int], grid: Sequence[int], codec: str | None = None
) -> None:
    """Raise ChunkFileError unless the stored metadata of `key` is the array the manifest claims."""
    got = parse_layout(stored_meta(root, key))
    want = (kind, dtype, list(shape), list(grid), codec)
    if got != want:
        what = "layout" if got is None else next(
            f"{n} is {g!r}, the manifest claims {w!r}"
            for n, g, w in zip(("storage", "data_type", "shape", "grid", "codec"), got, want) if g != w
        )
        raise ChunkFileError(f"{os.path.join(root, key, 'zarr.json')}: {what}")


def check_shard(
    root: str, key: str, itemsize: int, shape: Sequence[int], grid: Sequence[int], codec: str | None = None
) -> None:
    """Raise ChunkFileError unless the shard file of the "files" array at `key` holds at
    least what a box of `shape` in zarr chunks of `grid` needs (its index and every
    chunk with its crc32c): the manifest's claim against storage before anything is
    sized from it, in one `stat` (a cold load no longer reads every zarr.json first:
    the reads follow the checksummed manifest, and verify() still checks zarr.json)."""
    path = data_file(os.path.join(root, key), len(shape))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ChunkFileError(f"shard file {path} is missing") from None
    count = math.prod(len(r) for r in grid_ranges(shape, grid))
    need = 20 * count + 4 + (0 if codec else count * math.prod(grid) * itemsize)  # a compressed chunk: >= its crc
    if size < need:
        raise ChunkFileError(
            f"shard file {path} holds {size} bytes; a box of shape {list(shape)} in zarr chunks of "
            f"{list(grid)} ({itemsize}-byte items) needs at least {need}"
        )
