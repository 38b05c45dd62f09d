"""Byte-range reads of one stored file, wherever it lives.

A `Blob` is what the foreign-format readers (torch.save zips, DCP `.distcp`
files, safetensors files) read from: exact byte ranges by absolute offset
(`Blob.pread`, `Blob.readinto`), counted in `Blob.bytes_read`, so
a load of one eighth of a tensor reads about one eighth of its bytes from any
location. Three kinds:

* `LocalBlob`: a local file, `os.pread` / `os.preadv` straight into the
  caller's buffer (its descriptor is `Blob.local_fd`, for readers that map it);
* `KvBlob`: a key of a tensorstore kvstore (`s3://`, `gs://`, an
  S3-compatible endpoint given as a spec, `memory://`, `file://`): each read is
  one ranged `KvStore.read`;
* `HttpBlob` (in `_http`): an `http(s)://` URL read with Range
  requests.

Sizes. A local file and an http file know their size when opened. A kvstore has no
"stat": `Blob.size` is None until it is learned. Readers that need the end of
a file read its `Blob.tail` (one suffix range), and check a claimed extent with
`Blob.reaches` (a one-byte read at its end) before they trust it.

Errors: a range past the end of the file is a
[`CorruptChunkError`][xckpt.errors.CorruptChunkError] (the file is truncated); a file that is
gone is an [`IncompleteCheckpointError`][xckpt.errors.IncompleteCheckpointError]; a storage failure
(network, permission) is a [`StorageError`][xckpt.errors.StorageError] keeping the
tensorstore or OS error as its cause.

Blobs are thread-safe: readers issue reads from a thread pool.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from xckpt.errors import CorruptChunkError, IncompleteCheckpointError, XckptError

from ._location import storage_error

__all__ = ["Blob", "LocalBlob", "KvBlob"]


class Blob:
    """One stored file read by byte range (see the module docstring).

    Attributes:
        path: the file's location, as messages name it.
        where: what is being read (the checkpoint and format), for messages.
        size: the file's size in bytes, or None while unknown (kvstores).
        bytes_read: payload bytes read from storage so far (thread-safe count).
    """

    def __init__(self, path: str, where: str, size: int | None) -> None:
        self.path = path
        self.where = where
        self.size = size
        self.bytes_read = 0
        self._lock = threading.Lock()

    @property
    def local_fd(self) -> int | None:
        """The open descriptor of a local file (None elsewhere): readers may map it."""
        return None

    # -- what a kind implements -------------------------------------------------------------

    def _read(self, offset: int, n: int) -> bytes:
        """Exactly `n` bytes at `offset` (`n > 0`), or a typed error."""
        raise NotImplementedError

    def _read_tail(self, n: int) -> bytes:
        """The last `min(n, size)` bytes (`n > 0`)."""
        raise NotImplementedError

    # -- the read protocol --------------------------------------------------------------------

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def past_end(self, offset: int, n: int) -> CorruptChunkError:
        """The error for bytes `[offset, offset + n)` that the file does not hold."""
        size = f" ({self.size} bytes)" if self.size is not None else ""
        return CorruptChunkError(
            f"{self.where}: bytes [{offset}, {offset + n}) lie past the end of {self.path!r}{size}; "
            "the file is truncated: restore it from a copy or re-save"
        )

    def pread(self, offset: int, n: int) -> bytes:
        """Exactly `n` bytes at `offset` (CorruptChunkError if the file is shorter)."""
        if offset < 0 or n < 0 or (self.size is not None and offset + n > self.size):
            raise self.past_end(offset, n)
        if n == 0:
            return b""
        data = self._read(offset, n)
        self._count(n)
        return data

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill `buf` (a writable byte view) from `offset`."""
        n = buf.nbytes
        if n:
            buf.cast("B")[:] = self.pread(offset, n)

    def tail(self, n: int) -> bytes:
        """The last `min(n, size)` bytes of the file (one suffix read)."""
        if n <= 0:
            return b""
        if self.size is not None:
            k = min(n, self.size)
            return self.pread(self.size - k, k)
        data = self._read_tail(n)
        self._count(len(data))
        return data

    def head(self, n: int) -> bytes:
        """The first `min(n, size)` bytes of the file."""
        if n <= 0:
            return b""
        if self.size is not None:
            return self.pread(0, min(n, self.size))
        try:
            return self.pread(0, n)
        except CorruptChunkError:
            return self.tail(n)  # shorter than n bytes: the tail is the whole file

    def reaches(self, end: int) -> bool:
        """Whether the file holds at least `end` bytes (a one-byte read where the size is unknown)."""
        if end <= 0:
            return True
        if self.size is not None:
            return end <= self.size
        try:
            self.pread(end - 1, 1)
        except CorruptChunkError:
            return False
        return True

    def close(self) -> None:
        """Release what the blob holds open (idempotent)."""


class LocalBlob(Blob):
    """A local file read by `os.pread`, counting the bytes read."""

    size: int  # known from the open descriptor

    def __init__(self, path: str, where: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise XckptError(f"{where}: cannot open {path!r} ({e.strerror})") from None
        super().__init__(path, where, os.fstat(fd).st_size)
        self.fd = fd

    @property
    def local_fd(self) -> int | None:
        return self.fd if self.fd >= 0 else None

    def _descriptor(self) -> int:
        if self.fd < 0:
            raise XckptError(f"{self.where}: {self.path!r} is closed; open the checkpoint again")
        return self.fd

    def _read(self, offset: int, n: int) -> bytes:
        fd = self._descriptor()
        parts = []
        got = 0
        while got < n:
            b = os.pread(fd, n - got, offset + got)
            if not b:
                raise CorruptChunkError(f"{self.where}: {self.path!r} shrank while being read")
            parts.append(b)
            got += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, offset: int, buf: memoryview) -> None:
        n = buf.nbytes
        if offset < 0 or offset + n > (self.size or 0):
            raise self.past_end(offset, n)
        fd = self._descriptor()
        got = 0
        while got < n:
            k = os.preadv(fd, [buf[got:]], offset + got)
            if k <= 0:
                raise CorruptChunkError(f"{self.where}: {self.path!r} shrank while being read")
            got += k
        self._count(n)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _out_of_range(e: BaseException) -> bool:
    return "OUT_OF_RANGE" in str(e)


class KvBlob(Blob):
    """Key `key` of an open tensorstore `KvStore`: each read is one ranged `KvStore.read`.

    `size` is None until learned (a tail read of a file shorter than asked, or `size=`).
    """

    def __init__(self, kvstore: Any, key: str, path: str, where: str, size: int | None = None) -> None:
        super().__init__(path, where, size)
        self._kv = kvstore
        self._key = key

    def _get(self, byte_range: slice, what: str) -> bytes:
        try:
            r = self._kv.read(self._key, byte_range=byte_range).result()
        except ValueError as e:
            if _out_of_range(e):
                raise self.past_end(byte_range.start or 0, 0) from None
            raise storage_error(self.where, f"reading {what} of {self.path}", e) from e
        if r.state != "value":
            raise IncompleteCheckpointError(
                f"{self.where}: {self.path!r} is missing (it was removed after the checkpoint was "
                "opened, or never written): restore it from a copy or re-save the checkpoint"
            )
        return bytes(r.value)

    def _read(self, offset: int, n: int) -> bytes:
        try:
            data = self._get(slice(offset, offset + n), f"bytes [{offset}, {offset + n})")
        except CorruptChunkError:
            raise self.past_end(offset, n) from None
        if len(data) != n:
            raise self.past_end(offset, n)
        return data

    def _read_tail(self, n: int) -> bytes:
        try:
            return self._get(slice(-n, None), f"the last {n} bytes")
        except CorruptChunkError:
            # Shorter than n bytes: the whole file is the tail, and now its size is known.
            data = self._get(slice(None), "all bytes")
            self.size = len(data)
            return data
