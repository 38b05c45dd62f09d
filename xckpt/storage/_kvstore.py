"""tensorstore I/O: locations, kvstores, chunk arrays and small keys.

Everything that touches tensorstore lives here; :mod:`xckpt.writer` and
:mod:`xckpt.reader` speak only in keys, boxes and numpy arrays.

A location is a directory, a kvstore URL (``file://``, ``memory://``, ``gs://``,
``s3://``) or a tensorstore kvstore spec dict (how an S3-compatible endpoint, a
region or credentials are given: ``{"driver": "s3", "bucket": ..., "path": ...,
"endpoint": "http://host:port"}``). Layout of a checkpoint location::

    xckpt.json            merged manifest (optional, written last)
    ranks/<rank>.json     one manifest per writing rank
    data/<rank>/...       the rank's key space: chunk arrays t/<n>, packed small
                          chunks in ``packed``, large object bytes in o/<n>
    data/<rank>.<token>/  the same, for a save that overwrites (each overwriting
                          save has its own key space, so racing saves never
                          write into each other's data)

``data/<rank>/`` is one of (the manifest records which, per rank):

- ``"files"`` (the default on a local disk, format version 3): one directory per
  stored box holding ``zarr.json`` and one shard file ``c.0.0`` with all its zarr
  chunks and their index (:func:`array_metadata`); read and written directly by
  :mod:`._fileio` on a local disk, through tensorstore elsewhere;
- ``"plain"`` (versions 1 and 2): one file per zarr chunk, ``c/<i>/<j>`` (a directory
  per row of chunks: many more files and directories to create, fsync and open);
- ``"ocdbt"`` (the default for object stores and ``memory://``): one OCDBT
  database per rank, few objects however many arrays.

The tensorstore :class:`Context` is built in :func:`default_context` once per
process and passed explicitly to every open. One process-wide context is also
what keeps a ``memory://`` checkpoint readable until the process ends.

Every tensorstore failure under a read or write of storage (disk full, file too
large, permission, network) is raised as :class:`~xckpt.errors.StorageError`
naming the checkpoint and what was being read or written, with the tensorstore
error as ``__cause__`` (:func:`storage_error`). Conditional writes
(:meth:`Storage.read_stamped`, :meth:`Storage.write_if`) claim a location
atomically; tensorstore's file, memory and S3 kvstores support them.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno as errno_mod
import functools
import json
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np

from xckpt.errors import CorruptChunkError, StorageError, XckptError

__all__ = [
    "default_context",
    "Location",
    "location_url",
    "location_spec",
    "location_name",
    "local_root",
    "storage_error",
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


#: Characters a file URL may encode differently from the path (tensorstore decodes
#: percent escapes): such locations are read and written through tensorstore only.
_UNSAFE = set("%?#\\")


def local_root(url: Any) -> str | None:
    """The directory of a ``file://`` checkpoint URL, or None for other locations."""
    if not isinstance(url, str) or not url.startswith("file:///"):
        return None
    path = url[len("file://") :]
    if _UNSAFE & set(path):
        return None
    return path


def _raise(e: OSError) -> None:
    raise e


#: A checkpoint location: a directory, a kvstore URL or a kvstore spec dict.
Location = Union[str, "os.PathLike[str]", Mapping[str, Any]]


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


def location_spec(path: Location) -> str | dict[str, Any]:
    """A URL ending in ``/`` for a path or URL; for a kvstore spec dict, a copy whose
    ``path`` is empty or ends in ``/`` (the checkpoint is that directory)."""
    if isinstance(path, Mapping):
        spec = dict(path)
        if not isinstance(spec.get("driver"), str):
            raise XckptError(
                f"kvstore spec {spec!r} has no driver; a checkpoint location given as a dict is a "
                'tensorstore kvstore spec, e.g. {"driver": "s3", "bucket": "b", "path": "ckpt/", '
                '"endpoint": "http://127.0.0.1:9000"}'
            )
        sub = spec.get("path", "")
        if not isinstance(sub, str):
            raise XckptError(f"kvstore spec {spec!r}: path must be a string")
        spec["path"] = sub if not sub or sub.endswith("/") else sub + "/"
        return spec
    if not isinstance(path, (str, os.PathLike)):
        raise XckptError(
            f"checkpoint location {path!r} ({type(path).__name__}) is not a path, a kvstore URL or a "
            "kvstore spec dict"
        )
    return location_url(path)


_SECRET_RE = re.compile(r"secret|token|password|credential", re.I)


def location_name(path: Location) -> str:
    """How a location is named in messages: the path as given, a spec as JSON (secrets hidden)."""
    if isinstance(path, Mapping):
        shown = {k: ("***" if _SECRET_RE.search(str(k)) else v) for k, v in path.items()}
        return json.dumps(shown, sort_keys=True, default=str)
    return os.fspath(path)


def _child(loc: str | dict[str, Any], sub: str) -> Any:
    """The location ``sub`` below ``loc`` (a URL or a spec dict)."""
    if isinstance(loc, dict):
        return {**loc, "path": loc["path"] + sub}
    return loc + sub


_OS_ERRNO_RE = re.compile(r"os_error_code='?(\d+)|\[OS error (\d+)|errno[ =:]+(\d+)", re.I)
_STATUS_ERRNO = {
    "PERMISSION_DENIED": errno_mod.EACCES,
    "UNAUTHENTICATED": errno_mod.EACCES,
    "RESOURCE_EXHAUSTED": errno_mod.ENOSPC,
    "UNAVAILABLE": errno_mod.EHOSTUNREACH,
    "DEADLINE_EXCEEDED": errno_mod.ETIMEDOUT,
}


def _clean(err: BaseException) -> str:
    return str(err).split("[source locations=")[0].strip()


def storage_error(where: str, what: str, err: BaseException) -> StorageError:
    """A :class:`StorageError` for a tensorstore/OS failure of ``what`` at checkpoint ``where``.

    Raise it ``from err`` so the original error stays the cause. ``errno`` is the
    OS error when tensorstore reports one (``EFBIG``, ``ENOSPC``, ``EACCES``, ...).
    """
    msg = _clean(err)
    code = None
    m = _OS_ERRNO_RE.search(msg)
    if m is not None:
        code = int(next(g for g in m.groups() if g is not None))
    elif isinstance(err, OSError) and err.errno is not None:
        code = err.errno
    else:
        status = msg.split(":", 1)[0]
        code = _STATUS_ERRNO.get(status)
    hint = {
        errno_mod.ENOSPC: "the storage is full: free space (or raise the quota) and save again",
        errno_mod.EFBIG: "a file grew past the size limit of the file system or process (ulimit -f)",
        errno_mod.EDQUOT: "the storage quota is exhausted: free space and save again",
        errno_mod.EACCES: "permission denied: check the credentials and access rights of the location",
        errno_mod.EPERM: "permission denied: check the credentials and access rights of the location",
        errno_mod.EROFS: "the file system is read-only",
    }.get(code or -1, "check that the location is reachable and writable, then retry")
    text = f"checkpoint {where!r}: storage failed while {what} ({msg}); {hint}"
    return StorageError(code, text) if code is not None else StorageError(text)


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


def array_metadata(kind: str, dtype: str, shape: Sequence[int], grid: Sequence[int]) -> dict[str, Any]:
    """The zarr v3 metadata of a stored box, exactly as tensorstore writes it.

    ``"plain"``/``"ocdbt"``: a regular grid of ``grid`` chunks, each little-endian bytes
    then crc32c, keys ``c/<i>/<j>``. ``"files"`` (version 3): the same chunks inside one
    shard (``sharding_indexed``, index of (offset, nbytes) at the start with its own
    crc32c), so a box is one file ``c.0.0`` that a whole read takes in one request.
    """
    codecs = CODECS_1 if dtype in _ONE_BYTE else CODECS
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
    kvstore: Any, dtype: str, shape: Sequence[int], grid: Sequence[int], kind: str = "plain"
) -> dict[str, Any]:
    """A zarr v3 spec of a stored box (see :func:`array_metadata`)."""
    return {"driver": "zarr3", "kvstore": kvstore, "metadata": array_metadata(kind, dtype, shape, grid)}


class Storage:
    """One checkpoint location: small keys (manifests) and chunk arrays.

    tensorstore is imported and the location's kvstore opened on first use: reading a
    local directory's manifests (:meth:`read_key`, :meth:`read_keys`, :meth:`list_prefix`)
    uses plain file reads, so a process that only loads a local checkpoint, whose chunks
    :mod:`._fileio` reads, never imports tensorstore (0.11-0.16 s in every fresh
    process, cold or warm: bench/io.py and bench/jax_load.py time loads in fresh processes).
    """

    def __init__(self, path: Location, context: Any = None) -> None:
        #: The location as named in messages (a spec dict as JSON).
        self.path = location_name(path)
        #: The normalised location: a URL ending in "/" or a kvstore spec dict.
        self.url = location_spec(path)
        #: A local directory (manifests read with plain file reads), or None.
        self.root = local_root(self.url)
        self._context = context
        self._kvstore: Any = None

    @property
    def _ts(self) -> Any:
        import tensorstore as ts

        return ts

    @property
    def context(self) -> Any:
        if self._context is None:
            self._context = default_context()
        return self._context

    @property
    def _kv(self) -> Any:
        if self._kvstore is None:
            try:
                self._kvstore = self._ts.KvStore.open(self.url, context=self.context).result()
            except ValueError as e:
                raise storage_error(self.path, "opening the location", e) from e
        return self._kvstore

    def _result(self, fut: Any, what: str) -> Any:
        try:
            return fut.result()
        except ValueError as e:
            raise storage_error(self.path, what, e) from e

    # -- small keys ---------------------------------------------------------

    def _read_local(self, root: str, key: str) -> bytes | None:
        try:
            with open(os.path.join(root, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            raise storage_error(self.path, f"reading {key}", e) from e

    def read_key(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist."""
        if self.root is not None:
            return self._read_local(self.root, key)
        r = self._result(self._kv.read(key), f"reading {key}")
        if r.state != "value":
            return None
        return bytes(r.value)

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """The value of ``key`` (None when missing) and its storage generation, for :meth:`write_if`."""
        r = self._result(self._kv.read(key), f"reading {key}")
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def write_if(self, key: str, data: bytes | None, generation: bytes) -> bytes | None:
        """Write (or with ``data=None`` delete) ``key`` only if it is still at ``generation``
        (as :meth:`read_stamped` or a previous :meth:`write_if` returned it).

        Atomic on the file, memory and S3 kvstores. Returns the new generation, or
        None when the key changed in between (another writer came first).
        """
        g = self._result(self._kv.write(key, data, if_equal=generation), f"writing {key}")
        gen = bytes(g.generation)
        return gen if gen else None

    def write_key_stamped(self, key: str, data: bytes) -> bytes:
        """Write ``key`` and return its new generation."""
        return bytes(self._result(self._kv.write(key, data), f"writing {key}").generation)

    def unchanged(self, key: str, generation: bytes) -> bool:
        """Whether ``key`` is still at ``generation`` (a read that transfers no value if so)."""
        r = self._result(self._kv.read(key, if_not_equal=generation), f"reading {key}")
        return r.state == "unspecified"

    def read_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read many keys concurrently."""
        root = self.root
        if root is not None:
            if len(keys) <= 4:
                return [self._read_local(root, k) for k in keys]
            # Many rank manifests: concurrent, as the kvstore reads them (cold, each waits on the disk).
            with cf.ThreadPoolExecutor(min(16, len(keys)), thread_name_prefix="xckpt-manifests") as ex:
                return list(ex.map(functools.partial(self._read_local, root), keys))
        futs = [self._kv.read(k) for k in keys]
        out: list[bytes | None] = []
        for k, f in zip(keys, futs):
            r = self._result(f, f"reading {k}")
            out.append(bytes(r.value) if r.state == "value" else None)
        return out

    def write_key(self, key: str, data: bytes) -> None:
        """Write ``key`` atomically (and durably, on local disk)."""
        self._result(self._kv.write(key, data), f"writing {key}")

    def delete_key(self, key: str) -> None:
        self._result(self._kv.delete_range(self._ts.KvStore.KeyRange(key, key + "\0")), f"deleting {key}")

    def delete_prefix(self, prefix: str) -> None:
        self.delete_range(prefix, _prefix_end(prefix))

    def delete_range(self, start: str, end: str) -> None:
        """Delete every key in ``[start, end)``."""
        self._result(
            self._kv.delete_range(self._ts.KvStore.KeyRange(start, end)), f"deleting {start}..{end}"
        )

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""
        if self.root is not None and prefix.endswith("/"):
            return self._list_local(self.root, prefix)
        try:
            keys = self._result(self._kv.list(self._ts.KvStore.KeyRange(prefix, _prefix_end(prefix))), f"listing {prefix}")
        except NotImplementedError as e:  # a kvstore that cannot list (http)
            raise XckptError(
                f"checkpoint {self.path!r}: this location cannot be listed ({e}), and an xckpt "
                "checkpoint is found by listing ranks/; copy it to a local disk or an object store"
            ) from e
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    def _list_local(self, root: str, prefix: str) -> list[str]:
        """The files under directory ``prefix`` of a local location, as tensorstore's file
        kvstore lists them (its ``.__lock`` files left out)."""
        top = os.path.join(root, prefix)
        keys: list[str] = []
        try:
            for d, _dirs, files in os.walk(top, onerror=_raise):
                rel = os.path.relpath(d, root).replace(os.sep, "/")
                keys += [f"{rel}/{f}" for f in files if not f.endswith(".__lock")]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise storage_error(self.path, f"listing {prefix}", e) from e
        return sorted(keys)

    # -- data key spaces ----------------------------------------------------

    def data_kvstore(self, key: str, storage: str) -> Any:
        """The kvstore spec of a data key ``data/<rank>/<rest>`` (a directory)."""
        parts = key.split("/", 2)
        if len(parts) != 3 or parts[0] != "data":
            raise XckptError(f"{key!r} is not a data key")
        if storage == "ocdbt":
            return {**self._ocdbt_spec(parts[1]), "path": parts[2] + "/"}
        return _child(self.url, f"{key}/")

    def _ocdbt_spec(self, rank: str) -> dict[str, Any]:
        """The OCDBT database ``data/<rank>/`` (``rank`` is the key's directory name,
        e.g. ``0`` or ``0.<token>``): one spec for arrays and bytes alike, so a
        process opens it once (the same tensorstore driver instance)."""
        return {
            "driver": "ocdbt",
            "base": _child(self.url, f"data/{rank}/"),
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
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage)
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
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage)
        # A missing chunk is damage, never zeros.
        spec["fill_missing_data_reads"] = False
        return self._ts.open(
            spec, open=True, assume_metadata=True, read=True, context=self.context
        )

    def check_array(
        self, key: str, storage: str, dtype: str, shape: Sequence[int], grid: Sequence[int]
    ) -> Any:
        """A future that fails unless the stored zarr metadata of ``key`` matches the manifest's
        claim (dtype, shape, grid): a claim checked against storage before anything is sized by it."""
        spec = array_spec(self.data_kvstore(key, storage), dtype, shape, grid, storage)
        spec["fill_missing_data_reads"] = False
        return self._ts.open(spec, open=True, read=True, context=self.context)

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
        """Raw bytes under a data key, or None when they do not exist."""
        kv, k = self._byte_store(key, storage)
        try:
            r = kv.read(k).result()
        except ValueError as e:
            raise corrupt(f"checkpoint {self.path!r}, bytes {key}", e) from e
        return bytes(r.value) if r.state == "value" else None


def _prefix_end(prefix: str) -> str:
    if not prefix:
        return ""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def corrupt(where: str, err: Exception) -> CorruptChunkError:
    """A :class:`CorruptChunkError` for a tensorstore failure while reading a chunk."""
    msg = _clean(err)
    return CorruptChunkError(
        f"{where}: the stored data cannot be read or fails its checksum ({msg}). The checkpoint "
        "is damaged: restore this file from a copy or load an earlier checkpoint; "
        "`xckpt verify PATH` lists every damaged chunk"
    )
