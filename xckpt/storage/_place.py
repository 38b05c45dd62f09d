"""The one location model: a checkpoint location seen as a tree of files, wherever it is.

Foreign formats are files in directories (DCP's `.metadata` beside `*.distcp`,
orbax's item directories, a Hugging Face directory, one torch.save file). A
`Place` lets their readers detect and open them at any location with one
code path: it lists, probes and opens files (`Blob`) below it, and
gives tensorstore the kvstore spec of a directory (orbax's arrays). The xckpt
format and the manager read and write the same places as keys. Three kinds,
chosen by `as_place` from what a user passes:

* `LocalPlace`: a local path, or a `file://` URL (plain file I/O);
* `KvPlace`: a tensorstore kvstore URL (`s3://`, `gs://`, `memory://`)
  or a kvstore spec dict (how an S3-compatible endpoint, a region or credentials are
  given). Listing is the kvstore's (one recursive listing of the location, made once
  and shared with the places below it); a key is probed with a zero-length read.
  It is the kind that writes: `Storage` (the same class) opens any location,
  a local directory included, as keys to read, write, list and delete;
* `HttpPlace`: an `http(s)://` URL, or `{"driver": "http", "base_url": ...,
  "path": ..., "headers": [...]}` (tensorstore's http kvstore spec, whose headers,
  e.g. `Authorization`, go with every request to that host). An http location
  cannot be listed: files are found by probing their names. It is the one reader of
  an http location's files: a `KvPlace` (`Storage`) of one reads its keys through
  its `HttpPlace` (`http_place`), and hands tensorstore only its zarr arrays' spec.

File or directory: a local path is what the OS says. A kvstore location whose path
is empty or ends in "/" is a directory; otherwise it is a file when that key exists,
else a directory when keys lie below it. An http URL ending in "/" is a directory;
otherwise it is a file when the server has it, else a directory.

Paths below a place (`rel`) use "/" and never start with it; "" is the place itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from xckpt.errors import CheckpointNotFoundError, StorageError, XckptError

from ._blob import Blob, KvBlob, LocalBlob
from ._http import HttpBlob, http_headers
from ._location import (
    Location,
    checked_spec,
    child_location,
    default_context,
    local_root,
    location_name,
    location_spec,
    not_a_location,
    prefix_end,
    storage_error,
)

__all__ = ["Place", "LocalPlace", "KvPlace", "Storage", "HttpPlace", "as_place", "http_place", "file_to_detect"]

#: Largest file `Place.read` returns whole (metadata, indexes, manifests).
READ_CAP = 1 << 31


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:12]) + (f", ... ({len(entries)} entries)" if len(entries) > 12 else "")


class Place:
    """A location seen as files: the one location model (see the module docstring).

    Every kind reads (the file-tree protocol below); the kinds that can write
    (`KvPlace` and its `LocalPlace`) add keys read, written, listed and deleted.

    Attributes:
        name: the location as messages name it (a spec dict as JSON, secrets hidden).
        local: the local path, for a place on a local disk (else None).
        listable: whether `entries` and `files` can list (not over http).
        location: the location itself, as a path, URL or spec dict (for readers that
            take one, such as the xckpt format's).
    """

    name: str = ""
    location: Any = None
    local: str | None = None
    listable: bool = True

    def kind(self) -> str | None:
        """`"dir"`, `"file"`, or None when nothing is there."""
        raise NotImplementedError

    @property
    def base(self) -> str:
        """The last component of the location's path ("" for a bucket's root)."""
        raise NotImplementedError

    def child(self, rel: str) -> Place:
        """The place `rel` below this one."""
        raise NotImplementedError

    def parent(self) -> Place:
        """The directory holding this place."""
        raise NotImplementedError

    def entries(self, rel: str = "") -> list[str]:
        """Names directly below directory `rel`, sorted ([] when it is not a directory or
        cannot be listed)."""
        raise NotImplementedError

    def files(self, rel: str = "") -> list[str]:
        """Every file below directory `rel`, as paths relative to it, sorted."""
        raise NotImplementedError

    def isfile(self, rel: str = "") -> bool:
        raise NotImplementedError

    def isdir(self, rel: str = "") -> bool:
        raise NotImplementedError

    def read(self, rel: str = "", limit: int = READ_CAP) -> bytes | None:
        """File `rel` whole (a small file: metadata, an index), or None when it does not exist.

        A file over `limit` bytes comes back longer than `limit` (at least `limit + 1`
        bytes, where the location can bound a read): the caller refuses it.
        """
        raise NotImplementedError

    def open(self, rel: str = "", where: str | None = None) -> Blob:
        """File `rel` for byte-range reads; `where` names the reader in messages."""
        raise NotImplementedError

    def kvstore(self, rel: str = "") -> Any:
        """The tensorstore kvstore spec of directory `rel` (its path ends in "/")."""
        raise NotImplementedError

    def describe(self) -> str:
        """What is there, in words (for messages)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class KvPlace(Place):
    """A location in a tensorstore kvstore, read and written as keys: the kind of place that writes.

    Built from any location (a path, a kvstore URL or spec dict); `Storage` is this class,
    the name the xckpt format and the manager use for it. Keys are relative to the location
    as a directory (`url`). tensorstore is imported and the kvstore opened on first use: on
    a local disk (`local`) small keys are read and directories listed with plain file reads,
    so a process that only loads a local checkpoint, whose chunks `xckpt.native._fileio` reads, never
    imports tensorstore (0.11-0.16 s in every fresh process, cold or warm: bench/io.py and
    bench/jax_load.py time loads in fresh processes). Writes and deletes go through the
    kvstore; conditional writes (`read_stamped`, `write_if`) claim a key atomically on the
    file, memory and S3 kvstores.

    As a file tree (the `Place` protocol), a location whose path is empty or ends in "/"
    is a directory; otherwise it is a file when that key exists, else a directory when keys
    lie below it. Its listing is made once, and shared with the places below it; `list_prefix`
    lists afresh every time.

    Attributes:
        url: the location in directory form, which keys are relative to: a URL ending
            in "/" or a kvstore spec dict whose path is empty or ends in "/".
    """

    def __init__(self, location: Location, context: Any = None, *, name: str | None = None, given: Any = None) -> None:
        self.name = name if name is not None else location_name(location)
        self.location = given if given is not None else location
        self.url = location_spec(location)
        self.local = local_root(self.url)
        self._given = location.get("path", "") if isinstance(location, Mapping) else None
        self._context = context
        self._parsed: dict[str, Any] | None = None
        self._kvstore: Any = None
        self._stores: dict[str, Any] = {}
        self._listing: list[str] | None = None
        self._kind: str | None = None
        self._known = False
        # An http(s) location's files are read as `as_place` reads them, by its `HttpPlace`
        # (Range requests; redirects, proxies); only zarr arrays go through the kvstore spec.
        self._http = http_place(self.location)
        if self._http is not None:
            self.listable = False

    @property
    def spec(self) -> dict[str, Any]:
        """The location's kvstore spec as a dict, its path as given (a file's key kept as is)."""
        return {**self._spec(), "path": self._path}

    @property
    def path(self) -> str:
        """The location as messages name it (`name`)."""
        return self.name

    @property
    def root(self) -> str | None:
        """The local directory (keys read with plain file reads), or None (`local`)."""
        return self.local

    # -- tensorstore ------------------------------------------------------------------------

    @property
    def _ts(self) -> Any:
        import tensorstore as ts

        return ts

    @property
    def context(self) -> Any:
        if self._context is None:
            self._context = default_context()
        return self._context

    def _open(self, spec: Any) -> Any:
        try:
            return self._ts.KvStore.open(spec, context=self.context).result()
        except ValueError as e:
            raise storage_error(self.name, "opening the location", e) from e

    @property
    def _kv(self) -> Any:
        """The kvstore of the location as a directory (opened once)."""
        if self._kvstore is None:
            self._kvstore = self._open(self.url)
        return self._kvstore

    def _spec(self) -> dict[str, Any]:
        """The location's kvstore spec as a dict (a URL parsed by tensorstore, once)."""
        if isinstance(self.url, dict):
            return self.url
        if self._parsed is None:
            try:
                self._parsed = self._ts.KvStore.Spec(self.url).to_json()
            except ValueError as e:
                raise storage_error(self.name, "opening the location", e) from e
        return self._parsed

    def _store(self, path: str) -> Any:
        """The kvstore at `path` of the location's driver (opened once per place and path)."""
        store = self._stores.get(path)
        if store is None:
            store = self._stores[path] = self._open({**self._spec(), "path": path})
        return store

    def _result(self, fut: Any, what: str) -> Any:
        try:
            return fut.result()
        except ValueError as e:
            raise storage_error(self.name, what, e) from e

    # -- keys -------------------------------------------------------------------------------

    def _read_local(self, root: str, key: str) -> bytes | None:
        return _read_file(os.path.join(root, key), self.name, key)

    def _file_reads(self) -> Callable[[str], bytes | None] | None:
        """How keys are read as files (a local disk: plain reads; http(s): its `HttpPlace`),
        or None where the kvstore reads them."""
        if self._http is not None:
            return self._http.read
        if self.local is not None:
            return functools.partial(self._read_local, self.local)
        return None

    def read_key(self, key: str) -> bytes | None:
        """The value of `key`, or None when it does not exist."""
        read = self._file_reads()
        if read is not None:
            return read(key)
        r = self._result(self._kv.read(key), f"reading {key}")
        return bytes(r.value) if r.state == "value" else None

    def read_keys(self, keys: Sequence[str]) -> list[bytes | None]:
        """Read many keys concurrently."""
        read = self._file_reads()
        if read is not None:
            if len(keys) <= 4:
                return [read(k) for k in keys]
            # Many keys (rank manifests): concurrent, as the kvstore reads them (cold, each waits on the disk).
            with cf.ThreadPoolExecutor(min(16, len(keys)), thread_name_prefix="xckpt-manifests") as ex:
                return list(ex.map(read, keys))
        futs = [self._kv.read(k) for k in keys]
        out: list[bytes | None] = []
        for k, f in zip(keys, futs):
            r = self._result(f, f"reading {k}")
            out.append(bytes(r.value) if r.state == "value" else None)
        return out

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """The value of `key` (None when missing) and its storage generation, for `write_if`."""
        r = self._result(self._kv.read(key), f"reading {key}")
        return (bytes(r.value) if r.state == "value" else None), bytes(r.stamp.generation)

    def unchanged(self, key: str, generation: bytes) -> bool:
        """Whether `key` is still at `generation` (a read that transfers no value if so)."""
        r = self._result(self._kv.read(key, if_not_equal=generation), f"reading {key}")
        return r.state == "unspecified"

    def write_key(self, key: str, data: bytes) -> None:
        """Write `key` atomically (and durably, on local disk)."""
        self._result(self._kv.write(key, data), f"writing {key}")

    def write_key_stamped(self, key: str, data: bytes) -> bytes:
        """Write `key` and return its new generation."""
        return bytes(self._result(self._kv.write(key, data), f"writing {key}").generation)

    def write_if(self, key: str, data: bytes | None, generation: bytes) -> bytes | None:
        """Write (or with `data=None` delete) `key` only if it is still at `generation`
        (as `read_stamped` or a previous `write_if` returned it).

        Atomic on the file, memory and S3 kvstores. Returns the new generation, or
        None when the key changed in between (another writer came first).
        """
        g = self._result(self._kv.write(key, data, if_equal=generation), f"writing {key}")
        gen = bytes(g.generation)
        return gen if gen else None

    def delete_key(self, key: str) -> None:
        self._result(self._kv.delete_range(self._ts.KvStore.KeyRange(key, key + "\0")), f"deleting {key}")

    def delete_prefix(self, prefix: str) -> None:
        self.delete_range(prefix, prefix_end(prefix))

    def delete_range(self, start: str, end: str) -> None:
        """Delete every key in `[start, end)`."""
        self._result(self._kv.delete_range(self._ts.KvStore.KeyRange(start, end)), f"deleting {start}..{end}")

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, sorted (listed now, never from a kept listing)."""
        if self.local is not None and prefix.endswith("/"):
            return _list_local(self.local, prefix, self.name)
        if self._http is not None:
            raise _unlistable(self.name, prefix)
        try:
            keys = self._result(self._kv.list(self._ts.KvStore.KeyRange(prefix, prefix_end(prefix))), f"listing {prefix}")
        except NotImplementedError as e:  # a kvstore that cannot list
            raise _unlistable(self.name, prefix) from e
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    # -- the Place protocol -------------------------------------------------------------------

    @property
    def _dir(self) -> str:
        return str(self._spec().get("path", ""))

    @property
    def _path(self) -> str:
        """The path as given: a file's key when it does not end in "/"."""
        return self._given if self._given is not None else self._dir

    def _exists(self, key: str, shown: str) -> bool:
        """Whether `key` (relative to the bucket) exists: a zero-length read (a HEAD on S3)."""
        r = self._result(self._store("").read(key, byte_range=slice(0, 0)), f"reading {shown}")
        return r.state == "value"

    def _keys(self) -> list[str]:
        """Every key below the location (relative to it), listed once."""
        if self._listing is None:
            keys = self._result(self._kv.list(), "listing the location")
            self._listing = sorted(k.decode() if isinstance(k, bytes) else k for k in keys)
        return self._listing

    def kind(self) -> str | None:
        if self._http is not None:
            return self._http.kind()
        if not self._known:
            self._known = True
            path = self._path
            if path and not path.endswith("/") and self._exists(path, "it"):
                self._kind = "file"
            else:
                self._kind = "dir" if self._keys() else None
        return self._kind

    @property
    def base(self) -> str:
        return self._http.base if self._http is not None else self._path.rstrip("/").rsplit("/", 1)[-1]

    def _named(self, spec: dict[str, Any], rel: str | None) -> str:
        """The name of the place at `spec`, `rel` below this one (None: its parent)."""
        if self.name.startswith("{"):
            return location_name(spec)
        if rel is None:
            return self.name.rstrip("/").rpartition("/")[0] + "/"
        return self.name.rstrip("/") + "/" + rel

    def child(self, rel: str) -> KvPlace:
        if self.local is not None:  # a local disk's files are read as `as_place` reads them
            return LocalPlace(os.path.join(self.local, rel))
        spec = {**self._spec(), "path": self._dir + rel}
        c = KvPlace(spec, self._context, name=self._named(spec, rel))
        if self._listing is not None:  # known from this listing: no request
            pre = rel.rstrip("/") + "/"
            c._listing = [k[len(pre) :] for k in self._listing if k.startswith(pre)]
            c._known = True
            c._kind = "file" if rel in self._listing else "dir" if c._listing else None
        return c

    def parent(self) -> KvPlace:
        if self.local is not None:
            return LocalPlace(os.path.dirname(self.local.rstrip("/")) or "/")
        head = self._path.rstrip("/").rpartition("/")[0]
        spec = {**self._spec(), "path": head + "/" if head else ""}
        return KvPlace(spec, self._context, name=self._named(spec, None))

    def entries(self, rel: str = "") -> list[str]:
        if self._http is not None:
            return []
        pre = rel.rstrip("/") + "/" if rel else ""
        return sorted({k[len(pre) :].split("/", 1)[0] for k in self._keys() if k.startswith(pre) and k != pre})

    def files(self, rel: str = "") -> list[str]:
        if self._http is not None:
            return []
        pre = rel.rstrip("/") + "/" if rel else ""
        return [k[len(pre) :] for k in self._keys() if k.startswith(pre)]

    def isfile(self, rel: str = "") -> bool:
        if self._http is not None:
            return self._http.isfile(rel)
        if not rel:
            return self.kind() == "file"
        if self._listing is not None:
            return rel in self._listing
        return self._exists(self._dir + rel, rel)

    def isdir(self, rel: str = "") -> bool:
        if self._http is not None:
            return self._http.isdir(rel)
        if not rel:
            return self.kind() == "dir"
        pre = rel.rstrip("/") + "/"
        if self._listing is not None:
            return any(k.startswith(pre) for k in self._listing)
        return bool(self._result(self._kv.list(self._ts.KvStore.KeyRange(pre, prefix_end(pre))), f"listing {pre}"))

    def _key(self, rel: str) -> tuple[Any, str]:
        if not rel and self.kind() == "file":
            return self._store(self._path), ""
        return self._kv, rel

    def read(self, rel: str = "", limit: int = READ_CAP) -> bytes | None:
        if self._http is not None:
            return self._http.read(rel, limit)
        if not rel and self.kind() != "file":
            return None
        store, key = self._key(rel)
        r = self._result(store.read(key), f"reading {rel or 'it'}")
        return bytes(r.value) if r.state == "value" else None

    def open(self, rel: str = "", where: str | None = None) -> Blob:
        if self._http is not None:
            return self._http.open(rel, where)
        store, key = self._key(rel)
        path = self._named({**self._spec(), "path": self._dir + rel}, rel) if rel else self.name
        return KvBlob(store, key, path, where or path)

    def kvstore(self, rel: str = "") -> Any:
        return child_location(self.url, rel.rstrip("/") + "/" if rel else "")

    def describe(self) -> str:
        if self._http is not None:
            return self._http.describe()
        kind = self.kind()
        if kind is None:
            return "nothing (no key at or below it)"
        if kind == "file":
            return "an object (a file)"
        return f"a location holding {_shown(self.entries())}"


#: The kind of place that writes, by the name the xckpt format and the manager use.
Storage = KvPlace


class LocalPlace(KvPlace):
    """A local path: its files read with plain file I/O; its keys written through
    tensorstore's file kvstore (a spec dict, so a path is never percent-decoded)."""

    def __init__(self, path: str) -> None:
        super().__init__({"driver": "file", "path": os.path.abspath(path)}, name=path, given=path)
        self.local = path

    def _p(self, rel: str) -> str:
        return os.path.join(self.name, rel) if rel else self.name

    def kind(self) -> str | None:
        return "dir" if os.path.isdir(self.name) else "file" if os.path.isfile(self.name) else None

    @property
    def base(self) -> str:
        return os.path.basename(self.name.rstrip(os.sep)) or self.name

    def child(self, rel: str) -> LocalPlace:
        return LocalPlace(self._p(rel))

    def parent(self) -> LocalPlace:
        return LocalPlace(os.path.dirname(os.path.abspath(self.name)))

    def entries(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(rel)))
        except OSError:
            return []

    def files(self, rel: str = "") -> list[str]:
        top = self._p(rel)
        out = []
        for d, _dirs, names in os.walk(top):
            sub = os.path.relpath(d, top).replace(os.sep, "/")
            out += [n if sub == "." else f"{sub}/{n}" for n in names]
        return sorted(out)

    def isfile(self, rel: str = "") -> bool:
        return os.path.isfile(self._p(rel))

    def isdir(self, rel: str = "") -> bool:
        return os.path.isdir(self._p(rel))

    def read(self, rel: str = "", limit: int = READ_CAP) -> bytes | None:
        return _read_file(self._p(rel), self.name, rel or "it", limit)

    def open(self, rel: str = "", where: str | None = None) -> Blob:
        p = self._p(rel)
        return LocalBlob(p, where or p)

    def describe(self) -> str:
        p = self.name
        if not os.path.exists(p):
            return "nothing (the path does not exist)"
        if os.path.isfile(p):
            return f"a file of {os.path.getsize(p)} bytes"
        try:
            entries = sorted(os.listdir(p))
        except OSError as e:
            return f"an unreadable directory ({e.strerror})"
        return f"a directory holding {_shown(entries)}" if entries else "an empty directory"


def _read_file(path: str, name: str, what: str, limit: int | None = None) -> bytes | None:
    """Local file `path` whole (at most `limit + 1` bytes), or None when no file is there
    (missing, a directory, or below a file): the one local read of `LocalPlace.read` and
    `KvPlace.read_key`, so a failure is the same error from both.

    Raises:
        StorageError: any other OS failure (permission, I/O), naming location `name` and `what`.
    """
    try:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        raise storage_error(name, f"reading {what}", e) from e


def _unlistable(name: str, prefix: str) -> XckptError:
    return XckptError(
        f"checkpoint {name!r}: this location cannot be listed (http(s)), and reading it lists "
        f"{prefix or 'its keys'}; copy it to a local disk or an object store"
    )


def _list_local(root: str, prefix: str, name: str) -> list[str]:
    """The files under directory `prefix` of a local location, as tensorstore's file
    kvstore lists them (its `.__lock` files left out)."""
    top = os.path.join(root, prefix)
    keys: list[str] = []

    def fail(e: OSError) -> None:
        raise e

    try:
        for d, _dirs, files in os.walk(top, onerror=fail):
            rel = os.path.relpath(d, root).replace(os.sep, "/")
            keys += [f"{rel}/{f}" for f in files if not f.endswith(".__lock")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise storage_error(name, f"listing {prefix}", e) from e
    return sorted(keys)


class HttpPlace(Place):
    """An `http(s)://` location (files probed by name; nothing listed).

    Every read of an http(s) location's files goes through one (`http_place` builds it):
    a `Storage` of such a location reads its keys by its `HttpPlace` too.
    `location` is what was given (a spec dict keeps its headers for the readers that
    take a location).
    """

    listable = False

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str] | None = None,
        name: str | None = None,
        *,
        probes: Sequence[str] = (),
        location: Any = None,
    ) -> None:
        self.url = url
        self.location = url if location is None else location
        self.name = name or url
        self.probes = tuple(probes)
        self._headers = dict(headers or {})
        self._dir = url if url.endswith("/") else url + "/"
        self._blobs: dict[str, HttpBlob | None] = {}
        self._kind: str | None = None
        self._known = False

    def _probe(self, rel: str) -> HttpBlob | None:
        """File `rel` opened (its head read), or None when the server does not have it."""
        if rel not in self._blobs:
            url = self._dir + urllib.parse.quote(rel) if rel else self.url
            try:
                self._blobs[rel] = HttpBlob(url, f"{self.name}", self._headers)
            except CheckpointNotFoundError:
                self._blobs[rel] = None
        return self._blobs[rel]

    def kind(self) -> str | None:
        if not self._known:
            failed: StorageError | None = None
            if not self.url.endswith("/"):
                try:
                    if self._probe("") is not None:
                        self._kind = "file"
                except StorageError as e:  # a server may refuse a directory's URL (400, 403)
                    failed = e
            if self._kind is None and (self.url.endswith("/") or any(self._probe(p) is not None for p in self.probes)):
                self._kind = "dir"
            if self._kind is None and failed is not None:
                raise failed
            self._known = True
        return self._kind

    @property
    def base(self) -> str:
        return urllib.parse.urlsplit(self.url).path.rstrip("/").rsplit("/", 1)[-1]

    def _at(self, url: str) -> HttpPlace:
        """The place at `url` on the same server (its headers go with it, in `location` too)."""
        spec = {"driver": "http", "base_url": url, "headers": [f"{k}: {v}" for k, v in self._headers.items()]}
        return HttpPlace(url, self._headers, probes=self.probes, location=spec if self._headers else url)

    def child(self, rel: str) -> HttpPlace:
        return self._at(self._dir + urllib.parse.quote(rel))

    def parent(self) -> HttpPlace:
        return self._at(self.url.rstrip("/").rpartition("/")[0] + "/")

    def entries(self, rel: str = "") -> list[str]:
        return []

    def files(self, rel: str = "") -> list[str]:
        return []

    def isfile(self, rel: str = "") -> bool:
        if not rel:
            return self.kind() == "file"
        return self._probe(rel) is not None

    def isdir(self, rel: str = "") -> bool:
        return not rel and self.kind() == "dir"

    def read(self, rel: str = "", limit: int = READ_CAP) -> bytes | None:
        blob = self._probe(rel)
        self._blobs.pop(rel, None)  # read afresh next time (a key may be rewritten: a manifest)
        if blob is None:
            return None
        return blob.pread(0, min(blob.size or 0, limit + 1))

    def open(self, rel: str = "", where: str | None = None) -> Blob:
        blob = self._probe(rel)
        self._blobs.pop(rel, None)  # the caller owns it now
        if blob is None:
            url = self._dir + rel if rel else self.url
            raise CheckpointNotFoundError(f"{where or self.name}: {url!r} does not exist (HTTP 404)")
        if where is not None:
            blob.where = where
        return blob

    def kvstore(self, rel: str = "") -> Any:
        raise XckptError(
            f"{self.name!r}: an http(s) location cannot be listed, so this format cannot be read from "
            "it; copy the checkpoint to a local disk or an object store"
        )

    def describe(self) -> str:
        kind = self.kind()
        if kind == "file":
            blob = self._probe("")
            return f"an http(s) file of {blob.size if blob else '?'} bytes"
        if kind == "dir":
            return (
                "an http(s) location, which cannot be listed: probed "
                + ", ".join(f"{p} ({'found' if self._probe(p) else 'absent'})" for p in self.probes)
            )
        below = f", nor {' nor '.join(self.probes)} below it" if self.probes else ""
        return f"nothing (the server has no file there{below})"


def http_place(location: Any, *, probes: Sequence[str] = ()) -> HttpPlace | None:
    """The `HttpPlace` of an `http(s)://` URL or of tensorstore's http kvstore spec dict
    (`{"driver": "http", "base_url": ..., "path": ..., "headers": [...]}`), else None.

    The one parser of http(s) locations: `as_place` and `KvPlace` (`Storage`) both read
    an http(s) location through the place it returns, so it reads the same way wherever
    it is given.

    Raises:
        XckptError: an http spec without a `base_url` of `http(s)://`, or with bad headers.
    """
    if isinstance(location, str):
        return HttpPlace(location, probes=probes) if location.startswith(("http://", "https://")) else None
    if not isinstance(location, Mapping) or location.get("driver") != "http":
        return None
    spec = checked_spec(location)
    base = spec.get("base_url")
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        raise XckptError(f"http spec {location_name(spec)} needs a base_url of http(s)://")
    path = spec.get("path", "")
    url = base.rstrip("/") + "/" + path.lstrip("/") if path else base
    headers = http_headers(spec.get("headers"), url)
    return HttpPlace(url, headers, location_name(spec), probes=probes, location=spec)


@contextlib.contextmanager
def file_to_detect(place: Place) -> Iterator[Blob | None]:
    """The file at `place` opened for a format's detection (its magic bytes), closed after;
    None where no file is or it cannot be opened (detection says no, it never raises)."""
    try:
        blob = place.open(where=place.name) if place.kind() == "file" else None
    except XckptError:
        blob = None
    try:
        yield blob
    finally:
        if blob is not None:
            blob.close()


def as_place(location: Any, context: Any = None, *, probes: Sequence[str] = ()) -> Place:
    """The `Place` of a location: a `Place`, a local path (or `file://`
    URL), an `http(s)://` URL, another kvstore URL, or a kvstore spec dict.

    `probes` are the file names that mark a directory at an `http(s)://` location, which
    cannot be listed (the formats table gathers them from the formats that have such names).

    Raises:
        XckptError: `location` is none of these.
    """
    if isinstance(location, Place):
        return location
    if isinstance(location, os.PathLike):
        return LocalPlace(os.fspath(location))
    http = http_place(location, probes=probes)
    if http is not None:
        return http
    if isinstance(location, str):
        if location.startswith("file://"):
            return LocalPlace(location[len("file://") :])
        if "://" not in location:
            return LocalPlace(location)
        import tensorstore as ts

        try:
            spec = ts.KvStore.Spec(location).to_json()
        except ValueError as e:
            raise XckptError(f"{location!r} is not a kvstore URL tensorstore knows ({e})") from None
        return KvPlace(spec, context, name=location, given=location)
    if isinstance(location, Mapping):
        spec = checked_spec(location)
        if spec["driver"] == "file" and set(spec) <= {"driver", "path"}:
            return LocalPlace(spec["path"])
        return KvPlace(spec, context)
    raise not_a_location(location)
