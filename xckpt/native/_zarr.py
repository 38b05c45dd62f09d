"""The xckpt format's zarr arrays: their metadata, and the data key spaces that hold them.

A rank's data lives under `data/<rank>/` (`data/<rank>.<token>/` for a save that
overwrites, so racing saves never write into each other's data): chunk arrays
`t/<n>`, packed small chunks in `packed`, large object bytes in `o/<n>`. The
manifest records, per rank, which storage holds them:

- `"files"` (the default on a local disk, format version 3): one directory per
  stored box holding `zarr.json` and one shard file `c.0.0` with all its zarr
  chunks and their index ([array_metadata][xckpt.native._zarr.array_metadata]); read
  and written directly by `xckpt.native._fileio` on a local disk, through tensorstore
  elsewhere;
- `"plain"` (versions 1 and 2): one file per zarr chunk, `c/<i>/<j>`;
- `"ocdbt"` (the default for object stores and `memory://`): one OCDBT database
  per rank, few objects however many arrays.

[NativeStorage][xckpt.native._zarr.NativeStorage] adds these key spaces to a
location's `Storage` (the place that writes: small keys, listing, deletes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from xckpt.errors import XckptError
from xckpt.manifest import numpy_dtype
from xckpt.native._codecs import codec_json
from xckpt.storage import Storage, corrupt

__all__ = [
    "CODECS",
    "CODECS_1",
    "INNER_CHUNK_BYTES",
    "PACKED_CHUNK_BYTES",
    "NativeStorage",
    "array_metadata",
    "chunk_codecs",
    "array_spec",
    "inner_chunk_shape",
    "packed_grid",
    "shard_shape",
]

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


def inner_chunk_shape(shape: Sequence[int], itemsize: int, target: int = INNER_CHUNK_BYTES) -> list[int]:
    """zarr chunk shape for one stored box: split leading dims to about `target` bytes,
    and boxes over `MIN_INNER_BYTES * INNER_SPLITS` into at least `INNER_SPLITS` pieces,
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
    """The zarr chunk length of a packed byte array of `size` bytes: equal pieces of at most
    `PACKED_CHUNK_BYTES` (zarr stores an edge chunk at full size, so a 2 KiB array in a
    4 MiB grid would take 4 MiB on disk). Readers derive it from the manifest the same way."""
    pieces = max(1, -(-size // PACKED_CHUNK_BYTES))
    return max(1, -(-size // pieces))


#: Codecs of every chunk: little-endian bytes, then crc32c (as tensorstore writes them).
CODECS: list[dict[str, Any]] = [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}]
#: The same for one-byte types, which tensorstore writes without a byte order.
CODECS_1: list[dict[str, Any]] = [{"name": "bytes"}, {"name": "crc32c"}]
_ONE_BYTE = ("bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype.startswith("complex"):
        return [0.0, 0.0]
    if dtype.startswith(("int", "uint")):
        return 0
    return 0.0


def shard_shape(shape: Sequence[int], grid: Sequence[int]) -> list[int]:
    """The one shard of a "files" array: its shape rounded up to whole inner chunks."""
    return [-(-s // g) * g for s, g in zip(shape, grid)]


def chunk_codecs(dtype: str, codec: str | None = None) -> list[dict[str, Any]]:
    """The codec chain of one zarr chunk: bytes, `codec`'s codec (version 6), crc32c."""
    base = CODECS_1 if dtype in _ONE_BYTE else CODECS
    if codec is None:
        return base
    return [base[0], *codec_json(codec, numpy_dtype(dtype).itemsize), base[1]]


def array_metadata(
    kind: str, dtype: str, shape: Sequence[int], grid: Sequence[int], codec: str | None = None
) -> dict[str, Any]:
    """The zarr v3 metadata of a stored box, exactly as tensorstore writes it.

    `"plain"`/`"ocdbt"`: a regular grid of `grid` chunks, each little-endian bytes
    then crc32c, keys `c/<i>/<j>`. `"files"` (version 3): the same chunks inside one
    shard (`sharding_indexed`, index of (offset, nbytes) at the start with its own
    crc32c), so a box is one file `c.0.0` that a whole read takes in one request.
    `codec` (version 6, `xckpt.native._codecs`) compresses each zarr chunk's bytes
    before its crc32c.
    """
    codecs = chunk_codecs(dtype, codec)
    if kind == "files":
        grid_meta = shard_shape(shape, grid)
        codecs = [{
            "configuration": {
                "chunk_shape": list(grid),
                "codecs": codecs,
                "index_codecs": CODECS,
                "index_location": "start",
            },
            "name": "sharding_indexed",
        }]
        encoding: dict[str, Any] = {"configuration": {"separator": "."}, "name": "default"}
    else:
        grid_meta = list(grid)
        encoding = {"name": "default"}
    return {
        "chunk_grid": {"configuration": {"chunk_shape": grid_meta}, "name": "regular"},
        "chunk_key_encoding": encoding,
        "codecs": codecs,
        "data_type": dtype,
        "fill_value": _fill_value(dtype),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }


def array_spec(
    kvstore: Any, dtype: str, shape: Sequence[int], grid: Sequence[int], kind: str = "plain", codec: str | None = None
) -> dict[str, Any]:
    """A zarr v3 spec of a stored box (see `array_metadata`)."""
    return {"driver": "zarr3", "kvstore": kvstore, "metadata": array_metadata(kind, dtype, shape, grid, codec)}


class NativeStorage(Storage):
    """A checkpoint location with the xckpt format's data key spaces and zarr arrays."""

    # -- data key spaces ----------------------------------------------------

    def data_kvstore(self, key: str, storage: str) -> Any:
        """The kvstore spec of a data key `data/<rank>/<rest>` (a directory)."""
        parts = key.split("/", 2)
        if len(parts) != 3 or parts[0] != "data":
            raise XckptError(f"{key!r} is not a data key")
        if storage == "ocdbt":
            return {**self._ocdbt_spec(parts[1]), "path": parts[2] + "/"}
        return self.kvstore(key)

    def _ocdbt_spec(self, rank: str) -> dict[str, Any]:
        """The OCDBT database `data/<rank>/` (`rank` is the key's directory name,
        e.g. `0` or `0.<token>`): one spec for arrays and bytes alike, so a
        process opens it once (the same tensorstore driver instance)."""
        return {
            "driver": "ocdbt",
            "base": self.kvstore(f"data/{rank}"),
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
        codec: str | None = None,
    ) -> Any:
        """A future for a new zarr v3 array at `key` (inside `transaction` if given)."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage, codec)
        # Readers treat a missing zarr chunk as damage, so all-zero chunks must be stored too.
        spec["store_data_equal_to_fill_value"] = True
        return self._ts.open(spec, create=True, context=self.context, transaction=transaction)

    def transaction(self) -> Any:
        """A tensorstore transaction: its writes commit together (one OCDBT commit)."""
        return self._ts.Transaction()

    def open_array(
        self, key: str, storage: str, dtype: str, shape: Sequence[int], grid: Sequence[int], codec: str | None = None
    ) -> Any:
        """A future for an existing array, trusting the manifest for its metadata
        (no zarr.json read)."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage, codec)
        # A missing chunk is damage, never zeros.
        spec["fill_missing_data_reads"] = False
        return self._ts.open(
            spec, open=True, assume_metadata=True, read=True, context=self.context
        )

    def check_array(
        self, key: str, storage: str, dtype: str, shape: Sequence[int], grid: Sequence[int], codec: str | None = None
    ) -> Any:
        """A future that fails unless the stored zarr metadata of `key` matches the manifest's
        claim (dtype, shape, grid, codec): a claim checked against storage before anything is sized by it."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage, codec)
        spec["fill_missing_data_reads"] = False
        return self._ts.open(spec, open=True, read=True, context=self.context)

    def open_packed(self, key: str, storage: str) -> Any:
        """A future for a rank's packed byte array (its size comes from its zarr.json)."""
        spec = {"driver": "zarr3", "kvstore": self.data_kvstore(key, storage), "fill_missing_data_reads": False}
        return self._ts.open(spec, open=True, read=True, context=self.context)

    def wrap(self, out: np.ndarray) -> Any:
        """A writable TensorStore view of `out` (no copy), to read into."""
        return self._ts.array(out, copy=False, write=True, context=self.context)

    def _byte_store(self, key: str, storage: str) -> tuple[Any, str]:
        """The kvstore holding data key `key` as plain bytes, and its key there."""
        if storage == "ocdbt":
            parts = key.split("/", 2)
            kv = self._result(
                self._ts.KvStore.open(self._ocdbt_spec(parts[1]), context=self.context), f"opening {key}"
            )
            return kv, parts[2]
        return self._kv, key

    def write_bytes(self, key: str, storage: str, data: bytes) -> Any:
        """Store raw bytes (a large object) under a data key; returns a future."""
        kv, k = self._byte_store(key, storage)
        return kv.write(k, data)

    def read_bytes(self, key: str, storage: str) -> bytes | None:
        """Raw bytes under a data key, or None when they do not exist. Outside OCDBT the
        key is a file of the location, read as its other keys are (`read_key`: plain
        reads on a local disk, its `HttpPlace` over http(s))."""
        if storage != "ocdbt":
            return self.read_key(key)
        kv, k = self._byte_store(key, storage)
        try:
            r = kv.read(k).result()
        except ValueError as e:
            raise corrupt(f"checkpoint {self.path!r}, bytes {key}", e) from e
        return bytes(r.value) if r.state == "value" else None
