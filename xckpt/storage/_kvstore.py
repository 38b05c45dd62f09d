"""Locations and their small keys, through tensorstore's kvstores or plain file reads.

A location is a directory, a kvstore URL (`file://`, `memory://`, `gs://`, `s3://`)
or a tensorstore kvstore spec dict (how an S3-compatible endpoint, a region or
credentials are given: `{"driver": "s3", "bucket": ..., "path": ...,
"endpoint": "http://host:port"}`). [Storage][xckpt.storage.Storage] reads, writes,
lists and deletes keys in one; it knows no format (the xckpt format's arrays are
`xckpt.native`'s).

The tensorstore `Context` is built in [default_context][xckpt.storage.default_context]
once per process and passed explicitly to every open. One process-wide context is
also what keeps a `memory://` checkpoint readable until the process ends.

Every tensorstore failure under a read or write of storage (disk full, file too
large, permission, network) is raised as [StorageError][xckpt.errors.StorageError]
naming the checkpoint and what was being read or written, with the tensorstore
error as `__cause__` ([storage_error][xckpt.storage.storage_error]). Conditional
writes (`Storage.read_stamped`, `Storage.write_if`) claim a location atomically;
tensorstore's file, memory and S3 kvstores support them.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno as errno_mod
import functools
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Union

from xckpt.errors import CorruptChunkError, StorageError, XckptError

__all__ = [
    "default_context",
    "Location",
    "location_url",
    "location_spec",
    "location_name",
    "local_root",
    "storage_error",
    "checked_spec",
    "fsync_dir",
    "not_a_location",
    "Storage",
    "corrupt",
]

_CONTEXT = None
_CONTEXT_LOCK = threading.Lock()

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
    """The directory of a `file://` checkpoint URL, or None for other locations."""
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
    """Normalise a directory path or kvstore URL to a URL ending in `/`."""
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
    """A URL ending in `/` for a path or URL; for a kvstore spec dict, a copy whose
    `path` is empty or ends in `/` (the checkpoint is that directory)."""
    if isinstance(path, Mapping):
        spec = checked_spec(path)
        sub = spec.get("path", "")
        spec["path"] = sub if not sub or sub.endswith("/") else sub + "/"
        return spec
    if not isinstance(path, (str, os.PathLike)):
        raise not_a_location(path)
    return location_url(path)


def checked_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a location given as a tensorstore kvstore spec dict, its fields checked.

    The one check of a spec for every reader of locations ([location_spec][xckpt.storage.location_spec]
    and [as_place][xckpt.storage.as_place]).

    Raises:
        XckptError: no `driver`, or a `path` that is not a string.
    """
    out = dict(spec)
    if not isinstance(out.get("driver"), str):
        raise XckptError(
            f"kvstore spec {location_name(out)} has no driver; a checkpoint location given as a dict is a "
            'tensorstore kvstore spec, e.g. {"driver": "s3", "bucket": "b", "path": "ckpt/", '
            '"endpoint": "http://127.0.0.1:9000"}'
        )
    if not isinstance(out.get("path", ""), str):
        raise XckptError(f"kvstore spec {location_name(out)}: path must be a string")
    return out


def not_a_location(location: Any) -> XckptError:
    """The error for a value that is no location at all."""
    return XckptError(
        f"checkpoint location {location!r} ({type(location).__name__}) is not a path, a URL or a "
        "kvstore spec dict"
    )


_SECRET_RE = re.compile(r"secret|token|password|credential", re.I)


def location_name(path: Location) -> str:
    """How a location is named in messages: the path as given, a spec as JSON (secrets hidden)."""
    if isinstance(path, Mapping):
        shown = {k: ("***" if _SECRET_RE.search(str(k)) else v) for k, v in path.items()}
        return json.dumps(shown, sort_keys=True, default=str)
    return os.fspath(path)


def _child(loc: str | dict[str, Any], sub: str) -> Any:
    """The location `sub` below `loc` (a URL or a spec dict)."""
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


def _default_hint(what: str) -> str:
    """The advice for a failure with no known cause: what a read needs differs from a write."""
    if what.startswith(("reading", "listing", "opening")):
        return "check that the location exists, is reachable and readable, then retry"
    return "check that the location is reachable and writable, then retry"


def storage_error(where: str, what: str, err: BaseException) -> StorageError:
    """A [`StorageError`][xckpt.storage._kvstore.StorageError] for a tensorstore/OS failure of `what` at checkpoint `where`.

    Raise it `from err` so the original error stays the cause. `errno` is the
    OS error when tensorstore reports one (`EFBIG`, `ENOSPC`, `EACCES`, ...).
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
    }.get(code or -1, _default_hint(what))
    text = f"checkpoint {where!r}: storage failed while {what} ({msg}); {hint}"
    return StorageError(code, text) if code is not None else StorageError(text)


class Storage:
    """One checkpoint location: small keys (manifests) and chunk arrays.

    tensorstore is imported and the location's kvstore opened on first use: reading a
    local directory's manifests (`read_key`, `read_keys`, `list_prefix`)
    uses plain file reads, so a process that only loads a local checkpoint, whose chunks
    `_fileio` reads, never imports tensorstore (0.11-0.16 s in every fresh
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
        """The value of `key`, or None when it does not exist."""
        if self.root is not None:
            return self._read_local(self.root, key)
        r = self._result(self._kv.read(key), f"reading {key}")
        if r.state != "value":
            return None
        return bytes(r.value)

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """The value of `key` (None when missing) and its storage generation, for `write_if`."""
        r = self._result(self._kv.read(key), f"reading {key}")
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def write_if(self, key: str, data: bytes | None, generation: bytes) -> bytes | None:
        """Write (or with `data=None` delete) `key` only if it is still at `generation`
        (as `read_stamped` or a previous `write_if` returned it).

        Atomic on the file, memory and S3 kvstores. Returns the new generation, or
        None when the key changed in between (another writer came first).
        """
        g = self._result(self._kv.write(key, data, if_equal=generation), f"writing {key}")
        gen = bytes(g.generation)
        return gen if gen else None

    def write_key_stamped(self, key: str, data: bytes) -> bytes:
        """Write `key` and return its new generation."""
        return bytes(self._result(self._kv.write(key, data), f"writing {key}").generation)

    def unchanged(self, key: str, generation: bytes) -> bool:
        """Whether `key` is still at `generation` (a read that transfers no value if so)."""
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
        """Write `key` atomically (and durably, on local disk)."""
        self._result(self._kv.write(key, data), f"writing {key}")

    def delete_key(self, key: str) -> None:
        self._result(self._kv.delete_range(self._ts.KvStore.KeyRange(key, key + "\0")), f"deleting {key}")

    def delete_prefix(self, prefix: str) -> None:
        self.delete_range(prefix, _prefix_end(prefix))

    def delete_range(self, start: str, end: str) -> None:
        """Delete every key in `[start, end)`."""
        self._result(
            self._kv.delete_range(self._ts.KvStore.KeyRange(start, end)), f"deleting {start}..{end}"
        )

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted."""
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
        """The files under directory `prefix` of a local location, as tensorstore's file
        kvstore lists them (its `.__lock` files left out)."""
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

    def child(self, sub: str) -> Any:
        """The kvstore spec of directory `sub` inside this location."""
        return _child(self.url, sub)


def fsync_dir(path: str, *, missing_ok: bool = False) -> None:
    """Make a directory's entries durable (after files were created, renamed or removed in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prefix_end(prefix: str) -> str:
    if not prefix:
        return ""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def corrupt(where: str, err: Exception) -> CorruptChunkError:
    """A [`CorruptChunkError`][xckpt.storage._kvstore.CorruptChunkError] for a tensorstore failure while reading a chunk."""
    msg = _clean(err)
    return CorruptChunkError(
        f"{where}: the stored data cannot be read or fails its checksum ({msg}). The checkpoint "
        "is damaged: restore this file from a copy or load an earlier checkpoint; "
        "`xckpt verify PATH` lists every damaged chunk"
    )
