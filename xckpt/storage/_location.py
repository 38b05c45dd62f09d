"""Locations: what a user passes to name one, and the primitives every place is built on.

A location is a directory, a kvstore URL (`file://`, `memory://`, `gs://`, `s3://`)
or a tensorstore kvstore spec dict (how an S3-compatible endpoint, a region or
credentials are given: `{"driver": "s3", "bucket": ..., "path": ...,
"endpoint": "http://host:port"}`). Here it is checked and normalised once
(`location_spec`, `checked_spec`, `not_a_location`),
named in messages (`location_name`), and joined
(`child_location`); `_place` builds the one location model on these.

The tensorstore `Context` is built in `default_context`
once per process and passed explicitly to every open. One process-wide context is
also what keeps a `memory://` checkpoint readable until the process ends.

Every tensorstore failure under a read or write of storage (disk full, file too
large, permission, network) is raised as [StorageError][xckpt.errors.StorageError]
naming the checkpoint and what was being read or written, with the tensorstore
error as `__cause__` (`storage_error`).
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import re
import threading
from collections.abc import Mapping
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
    "child_location",
    "prefix_end",
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

    The one check of a spec for every reader of locations (`location_spec`
    and `as_place`).

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


_SECRET_RE = re.compile(r"secret|token|password|credential|headers", re.I)


def location_name(path: Location) -> str:
    """How a location is named in messages: the path as given, a spec as JSON (secrets hidden,
    and an http spec's headers, which carry its tokens)."""
    if isinstance(path, Mapping):
        shown = {k: ("***" if _SECRET_RE.search(str(k)) else v) for k, v in path.items()}
        return json.dumps(shown, sort_keys=True, default=str)
    return os.fspath(path)


def child_location(loc: str | dict[str, Any], sub: str) -> Any:
    """The location `sub` below `loc` (a URL or a spec dict in directory form)."""
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
    """A [`StorageError`][xckpt.errors.StorageError] for a tensorstore/OS failure of `what` at checkpoint `where`.

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


def prefix_end(prefix: str) -> str:
    """The end of the key range of every key starting with `prefix` ("" for all keys)."""
    if not prefix:
        return ""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def corrupt(where: str, err: Exception) -> CorruptChunkError:
    """A [`CorruptChunkError`][xckpt.errors.CorruptChunkError] for a tensorstore failure while reading a chunk."""
    msg = _clean(err)
    return CorruptChunkError(
        f"{where}: the stored data cannot be read or fails its checksum ({msg}). The checkpoint "
        "is damaged: restore this file from a copy or load an earlier checkpoint; "
        "`xckpt verify PATH` lists every damaged chunk"
    )
