"""tensorstore I/O: locations, kvstores, chunk arrays and small keys.

Everything that touches tensorstore lives here; :mod:`xckpt.writer` and
:mod:`xckpt.reader` speak only in keys, boxes and numpy arrays.

Layout of a checkpoint location (a directory or a kvstore URL)::

    xckpt.json            merged manifest (optional, written last)
    ranks/<rank>.json     one manifest per writing rank
    data/<rank>/...       the rank's key space: chunk arrays t/<n>, packed small
                          chunks in ``packed``, large object bytes in o/<n>

``data/<rank>/`` is either an OCDBT database (``storage = "ocdbt"``, the
default: few files however many arrays) or plain keys (``"plain"``, one file
per zarr chunk); the manifest records which, per rank.

The tensorstore :class:`Context` is built in :func:`default_context` once per
process and passed explicitly to every open. One process-wide context is also
what keeps a ``memory://`` checkpoint readable until the process ends.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from xckpt.errors import CorruptChunkError, XckptError

__all__ = [
    "default_context",
    "location_url",
    "Storage",
    "inner_chunk_shape",
    "array_spec",
]

_CONTEXT = None
_CONTEXT_LOCK = threading.Lock()

#: Target size of one zarr chunk inside a stored box: large enough that I/O is
#: sequential, small enough that a partial load reads little more than it needs.
INNER_CHUNK_BYTES = 16 << 20
#: Boxes larger than this many inner chunks' worth are split in at least this many.
INNER_SPLITS = 8
MIN_INNER_BYTES = 1 << 20

#: Size at which an OCDBT database starts a new data file. A writer-side knob
#: only (readers follow the B-tree): tensorstore writes the data files of one
#: commit concurrently, so files of 64 MiB instead of one large file halve the
#: time of a 1 GiB save on local disk (bench/io.py) at about 16 files per GiB.
OCDBT_DATA_FILE_BYTES = 64 << 20


def default_context() -> Any:
    """The process-wide tensorstore Context (no chunk cache; fsync on commit)."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            import tensorstore as ts

            cpus = os.cpu_count() or 2
            _CONTEXT = ts.Context(
                {
                    "cache_pool": {"total_bytes_limit": 0},
                    "data_copy_concurrency": {"limit": max(2, cpus)},
                    "file_io_concurrency": {"limit": max(8, 4 * cpus)},
                    "file_io_sync": True,
                }
            )
        return _CONTEXT


def location_url(path: str | os.PathLike[str]) -> str:
    """Normalise a directory path or kvstore URL to a URL ending in ``/``."""
    p = os.fspath(path)
    if "://" in p:
        scheme, rest = p.split("://", 1)
        if scheme == "file":
            rest = os.path.abspath(rest)
            return "file://" + rest.rstrip("/") + "/"
        if not rest:
            raise XckptError(f"checkpoint location {p!r} names no path after {scheme}://")
        return p.rstrip("/") + "/"
    return "file://" + os.path.abspath(p).rstrip("/") + "/"


def inner_chunk_shape(shape: Sequence[int], itemsize: int, target: int = INNER_CHUNK_BYTES) -> list[int]:
    """zarr chunk shape for one stored box: split leading dims to about ``target`` bytes,
    and boxes over ``MIN_INNER_BYTES * INNER_SPLITS`` into at least ``INNER_SPLITS`` pieces,
    so a rank loading 1/W' of the rows reads little more than its share."""
    nbytes = itemsize * math.prod(shape)
    target = min(target, max(MIN_INNER_BYTES, nbytes // INNER_SPLITS))
    cs = [max(1, s) for s in shape]
    for d in range(len(cs)):
        rest = itemsize * math.prod(cs[d + 1 :])
        if rest * cs[d] <= target:
            break
        # As many pieces as the target needs, then equal pieces: zarr pads the edge
        # chunk to full size, so 128 rows as 93 + 35 would store 186 rows.
        pieces = -(-cs[d] // max(1, target // rest))
        cs[d] = -(-cs[d] // pieces)
    return cs


#: Target size of one zarr chunk of a rank's packed byte array.
PACKED_CHUNK_BYTES = 4 << 20


def packed_grid(size: int) -> int:
    """The zarr chunk length of a packed byte array of ``size`` bytes: equal pieces of at most
    :data:`PACKED_CHUNK_BYTES` (zarr stores an edge chunk at full size, so a 2 KiB array in a
    4 MiB grid would take 4 MiB on disk). Readers derive it from the manifest the same way."""
    pieces = max(1, -(-size // PACKED_CHUNK_BYTES))
    return max(1, -(-size // pieces))


def _codecs() -> list[dict[str, Any]]:
    return [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def array_spec(kvstore: Any, dtype: str, shape: Sequence[int], grid: Sequence[int]) -> dict[str, Any]:
    """A zarr v3 spec: regular grid, little-endian bytes, crc32c per chunk."""
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
            "chunk_key_encoding": {"name": "default"},
            "data_type": dtype,
            "codecs": _codecs(),
        },
    }


class Storage:
    """One checkpoint location: small keys (manifests) and chunk arrays."""

    def __init__(self, path: str | os.PathLike[str], context: Any = None) -> None:
        import tensorstore as ts

        self._ts = ts
        self.path = os.fspath(path)
        self.url = location_url(path)
        self.context = context if context is not None else default_context()
        self._kv = ts.KvStore.open(self.url, context=self.context).result()

    # -- small keys ---------------------------------------------------------

    def read_key(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist."""
        r = self._kv.read(key).result()
        if r.state != "value":
            return None
        return bytes(r.value)

    def read_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read many keys concurrently."""
        futs = [self._kv.read(k) for k in keys]
        out: list[bytes | None] = []
        for f in futs:
            r = f.result()
            out.append(bytes(r.value) if r.state == "value" else None)
        return out

    def write_key(self, key: str, data: bytes) -> None:
        """Write ``key`` atomically (and durably, on local disk)."""
        self._kv.write(key, data).result()

    def delete_key(self, key: str) -> None:
        self._kv.delete_range(self._ts.KvStore.KeyRange(key, key + "\0")).result()

    def delete_prefix(self, prefix: str) -> None:
        self._kv.delete_range(self._ts.KvStore.KeyRange(prefix, _prefix_end(prefix))).result()

    def list_prefix(self, prefix: str) -> list[str]:
        keys = self._kv.list(self._ts.KvStore.KeyRange(prefix, _prefix_end(prefix))).result()
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    # -- data key spaces ----------------------------------------------------

    def data_kvstore(self, key: str, storage: str) -> Any:
        """The kvstore spec of a data key ``data/<rank>/<rest>`` (a directory)."""
        parts = key.split("/", 2)
        if len(parts) != 3 or parts[0] != "data":
            raise XckptError(f"{key!r} is not a data key")
        if storage == "ocdbt":
            return {**self._ocdbt_spec(parts[1]), "path": parts[2] + "/"}
        return f"{self.url}{key}/"

    def _ocdbt_spec(self, rank: str) -> dict[str, Any]:
        """Rank ``rank``'s OCDBT database: one spec for arrays and bytes alike, so a
        process opens it once (the same tensorstore driver instance)."""
        return {
            "driver": "ocdbt",
            "base": f"{self.url}data/{rank}/",
            "target_data_file_size": OCDBT_DATA_FILE_BYTES,
        }

    def create_array(
        self,
        key: str,
        storage: str,
        dtype: str,
        shape: Sequence[int],
        grid: Sequence[int],
        transaction: Any = None,
    ) -> Any:
        """A future for a new zarr v3 array at ``key`` (inside ``transaction`` if given)."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid)
        # Readers treat a missing zarr chunk as damage, so all-zero chunks must be stored too.
        spec["store_data_equal_to_fill_value"] = True
        return self._ts.open(spec, create=True, context=self.context, transaction=transaction)

    def transaction(self) -> Any:
        """A tensorstore transaction: its writes commit together (one OCDBT commit)."""
        return self._ts.Transaction()

    def open_array(
        self, key: str, storage: str, dtype: str, shape: Sequence[int], grid: Sequence[int]
    ) -> Any:
        """A future for an existing array, trusting the manifest for its metadata
        (no zarr.json read)."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid)
        # A missing chunk is damage, never zeros.
        spec["fill_missing_data_reads"] = False
        return self._ts.open(
            spec, open=True, assume_metadata=True, read=True, context=self.context
        )

    def open_packed(self, key: str, storage: str) -> Any:
        """A future for a rank's packed byte array (its size comes from its zarr.json)."""
        spec = {"driver": "zarr3", "kvstore": self.data_kvstore(key, storage), "fill_missing_data_reads": False}
        return self._ts.open(spec, open=True, read=True, context=self.context)

    def wrap(self, out: np.ndarray) -> Any:
        """A writable TensorStore view of ``out`` (no copy), to read into."""
        return self._ts.array(out, copy=False, write=True, context=self.context)

    def _byte_store(self, key: str, storage: str) -> tuple[Any, str]:
        """The kvstore holding data key ``key`` as plain bytes, and its key there."""
        if storage == "ocdbt":
            parts = key.split("/", 2)
            kv = self._ts.KvStore.open(self._ocdbt_spec(parts[1]), context=self.context).result()
            return kv, parts[2]
        return self._kv, key

    def write_bytes(self, key: str, storage: str, data: bytes) -> Any:
        """Store raw bytes (a large object) under a data key; returns a future."""
        kv, k = self._byte_store(key, storage)
        return kv.write(k, data)

    def read_bytes(self, key: str, storage: str) -> bytes | None:
        """Raw bytes under a data key, or None when they do not exist."""
        kv, k = self._byte_store(key, storage)
        r = kv.read(k).result()
        return bytes(r.value) if r.state == "value" else None


def _prefix_end(prefix: str) -> str:
    if not prefix:
        return ""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def corrupt(where: str, err: Exception) -> CorruptChunkError:
    """A :class:`CorruptChunkError` for a tensorstore failure while reading a chunk."""
    msg = str(err).split("[source locations=")[0].strip()
    return CorruptChunkError(
        f"{where}: the stored data cannot be read or fails its checksum ({msg}). The checkpoint "
        "is damaged: restore this file from a copy or load an earlier checkpoint; "
        "`xckpt verify PATH` lists every damaged chunk"
    )
