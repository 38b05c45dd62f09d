"""torch.save zip archives read by byte range, without torch.

A torch.save file (and each tensor item of a DCP `.distcp` file, which is a
complete torch.save archive at a byte range of the file) is a zip of
ZIP_STORED records `<archive>/data.pkl`, `<archive>/data/<key>` (one per
storage), `<archive>/byteorder` and a few small ones. The archive name
varies (`archive` for streams, the file's stem otherwise), so records are
located by the one `*/data.pkl`.

`Archive` parses the end-of-central-directory record (zip64 too), the
central directory, `data.pkl` (with the restricted unpickler of
`_unpickle`) and `byteorder`; offsets are relative to the archive's
start, as torch writes them. Storage records are found lazily from their
local headers. `read_box` copies a box of a tensor (size, stride and
storage offset as `data.pkl` describes it) into a numpy array, reading only
the byte span the box touches, straight into the target when the box is one
contiguous run. Every header, offset and size is checked against the archive's
range before it is used; anything inconsistent is an [`XckptError`][xckpt._parts.XckptError].
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Any, NamedTuple, Protocol

import numpy as np

from xckpt.errors import CorruptChunkError, XckptError
from xckpt.storage import Blob, LocalBlob

from ._unpickle import TORCH_SAVE_GLOBALS, StorageRef, TensorRef, restricted_load

__all__ = [
    "FileBytes",
    "Archive",
    "zip_length",
    "StoredBytes",
    "read_box",
    "read_boxes",
    "LEGACY_MAGIC",
    "ZIP_MAGIC",
    "first_record_name",
]

ZIP_MAGIC = b"PK\x03\x04"
#: torch.save's pre-1.6 format: a protocol-2 pickle whose first value is this magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"

_EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
_LOC64 = struct.Struct("<4sIQI")  # 20 bytes
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
_CDIR = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_TAIL = 1024  # first look at an archive's end: EOCD + a torch-sized central directory
_WHOLE = 64 << 10  # archives this small are read in one go
_MAX_RECORDS = 1 << 20
_EXPAND_LIMIT = 1 << 30
_SLAB = 64 << 20  # bytes of a tensor held at once when several boxes are cut from it


#: A local file read by `os.pread` (kept under its old name: other readers import it).
FileBytes = LocalBlob


class _Record(NamedTuple):
    name: str
    local: int  # local header offset, relative to the archive
    size: int
    method: int


def first_record_name(head: bytes) -> str | None:
    """The name of a zip's first record from its first bytes (None if not a zip)."""
    if len(head) < _LOCAL.size or head[:4] != ZIP_MAGIC:
        return None
    n = _LOCAL.unpack_from(head)[9]
    return head[_LOCAL.size : _LOCAL.size + n].decode("utf-8", "replace")


class Archive:
    """One torch.save archive at `[base, base + length)` of a file (any `Blob`).

    Attributes:
        prefix: the archive name (`archive` for streams).
        big_endian: the `byteorder` record says `big`.
        root: `data.pkl` unpickled with the restricted unpickler; with `foreign=True`
            classes outside the allow-list become inert placeholders
            (`_foreign`) instead of refusing the file.
    """

    def __init__(
        self,
        file: Blob,
        base: int,
        length: int,
        where: str,
        *,
        unpickle: bool = True,
        foreign: bool = False,
        tail: bytes | None = None,
    ) -> None:
        self.file, self.base, self.length, self.where = file, base, length, where
        if base < 0 or length < 0 or (file.size is not None and base + length > file.size):
            raise CorruptChunkError(
                f"{where}: the archive at bytes [{base}, {base + length}) lies past the end of "
                f"{file.path!r} ({file.size} bytes); the file is truncated: restore it or re-save"
            )
        self._blob = file.pread(base, length) if length <= _WHOLE else None
        self._data: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.records = self._central_directory(tail)
        pkls = [n for n in self.records if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise self._bad(f"expected one <archive>/data.pkl record, found {pkls[:5]}")
        self.prefix = pkls[0][: -len("/data.pkl")]
        order = self.records.get(f"{self.prefix}/byteorder")
        self.big_endian = False
        if order is not None:
            value = self.record_bytes(order.name)
            if value not in (b"little", b"big"):
                raise self._bad(f"byteorder record says {value[:20]!r}")
            self.big_endian = value == b"big"
        self.root: Any = None
        if unpickle:
            data = self.record_bytes(pkls[0])
            self.root = restricted_load(data, TORCH_SAVE_GLOBALS, where, storages=True, foreign=foreign)

    @classmethod
    def of_file(cls, file: Blob, where: str, **options: Any) -> Archive:
        """The archive that is the whole of `file` (a torch.save file).

        A file whose size is unknown (a kvstore key) is sized from its zip end records,
        read with one suffix read that also serves as the central directory's first look.
        """
        if file.size is not None:
            return cls(file, 0, file.size, where, **options)
        tail = file.tail(_TAIL)
        length = zip_length(tail) if file.size is None else file.size
        if length is None and len(tail) == _TAIL:
            tail = file.tail(65535 + _EOCD.size + _LOC64.size + _EOCD64.size)
            length = zip_length(tail)
        if length is None:
            length = file.size  # the file was shorter than the tail asked for: its size is known
        if length is None or length < len(tail):
            raise CorruptChunkError(
                f"{where}: not a valid torch.save archive: no end-of-central-directory record "
                "(truncated, or not a zip)"
            )
        file.size = length
        return cls(file, 0, length, where, tail=tail, **options)

    # -- raw access -------------------------------------------------------------

    def _bad(self, what: str) -> CorruptChunkError:
        return CorruptChunkError(f"{self.where}: not a valid torch.save archive: {what}")

    def _get(self, off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > self.length:
            raise self._bad(f"bytes [{off}, {off + n}) lie outside the archive's {self.length} bytes")
        blob = self._blob
        if blob is not None:
            return blob[off : off + n]
        return self.file.pread(self.base + off, n)

    def _central_directory(self, tail: bytes | None = None) -> dict[str, _Record]:
        if self.length < _EOCD.size:
            raise self._bad(f"{self.length} bytes is too short for a zip")
        if tail is not None and len(tail) >= min(self.length, _TAIL) and self.base == 0:
            tail = tail[len(tail) - min(self.length, len(tail)) :]  # the archive's last bytes, read already
            tail_len = len(tail)
        else:
            tail_len = min(self.length, _TAIL)
            tail = self._get(self.length - tail_len, tail_len)
        pos = self._find_eocd(tail)
        if pos is None and tail_len < self.length:
            tail_len = min(self.length, 65535 + _EOCD.size + _LOC64.size)
            tail = self._get(self.length - tail_len, tail_len)
            pos = self._find_eocd(tail)
        if pos is None:
            raise self._bad("no end-of-central-directory record (truncated, or not a zip)")
        eocd_at = self.length - tail_len + pos
        _, disk, cd_disk, _, count, cd_size, cd_off, _ = _EOCD.unpack_from(tail, pos)
        if disk or cd_disk:
            raise self._bad("multi-disk zips are not torch.save archives")
        if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF:
            loc = self._get(eocd_at - _LOC64.size, _LOC64.size) if eocd_at >= _LOC64.size else b""
            if len(loc) != _LOC64.size or loc[:4] != b"PK\x06\x07":
                raise self._bad("zip64 end-of-central-directory locator missing")
            e64_off = _LOC64.unpack(loc)[2]
            e64 = self._get(e64_off, _EOCD64.size)
            if e64[:4] != b"PK\x06\x06":
                raise self._bad("zip64 end-of-central-directory record missing")
            count, cd_size, cd_off = _EOCD64.unpack(e64)[7:10]
            eocd_at = e64_off
        if cd_off + cd_size > eocd_at or count > min(_MAX_RECORDS, cd_size // _CDIR.size):
            raise self._bad(f"central directory ({count} records, [{cd_off}, {cd_off + cd_size})) is inconsistent")
        cd = self._get(cd_off, cd_size)
        records: dict[str, _Record] = {}
        p = 0
        for _ in range(count):
            if p + _CDIR.size > len(cd):
                raise self._bad("central directory is truncated")
            f = _CDIR.unpack_from(cd, p)
            if f[0] != b"PK\x01\x02":
                raise self._bad(f"bad central directory entry at {cd_off + p}")
            method, csize, usize, nlen, xlen, clen, local = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
            end = p + _CDIR.size + nlen + xlen + clen
            if end > len(cd):
                raise self._bad("central directory is truncated")
            try:
                name = cd[p + _CDIR.size : p + _CDIR.size + nlen].decode("utf-8")
            except UnicodeDecodeError:
                raise self._bad("a record name is not UTF-8") from None
            extra = cd[p + _CDIR.size + nlen : p + _CDIR.size + nlen + xlen]
            usize, csize, local = _zip64(extra, usize, csize, local, self._bad)
            if method != 0 or csize != usize:
                raise self._bad(f"record {name!r} is compressed (method {method}); torch.save stores records")
            if name in records:
                raise self._bad(f"record {name!r} appears twice")
            if local + _LOCAL.size + usize > cd_off:
                raise self._bad(f"record {name!r} ([{local}, +{usize})) overlaps the central directory")
            records[name] = _Record(name, local, usize, method)
            p = end
        return records

    @staticmethod
    def _find_eocd(tail: bytes) -> int | None:
        pos = len(tail)
        while True:
            pos = tail.rfind(b"PK\x05\x06", 0, pos)
            if pos < 0:
                return None
            if pos + _EOCD.size <= len(tail):
                clen = _EOCD.unpack_from(tail, pos)[7]
                if pos + _EOCD.size + clen == len(tail):
                    return pos

    def data_range(self, name: str) -> tuple[int, int]:
        """(absolute file offset, size) of record `name`'s data."""
        got = self._data.get(name)
        if got is not None:
            return got
        rec = self.records.get(name)
        if rec is None:
            raise self._bad(f"record {name!r} is missing")
        head = self._get(rec.local, _LOCAL.size)
        f = _LOCAL.unpack(head)
        if f[0] != ZIP_MAGIC:
            raise self._bad(f"record {name!r} has no local header at {rec.local}")
        start = rec.local + _LOCAL.size + f[9] + f[10]
        if start + rec.size > self.length:
            raise self._bad(f"record {name!r} ([{start}, {start + rec.size})) runs past the archive's end")
        got = (self.base + start, rec.size)
        with self._lock:
            self._data[name] = got
        return got

    def record_bytes(self, name: str) -> bytes:
        start, size = self.data_range(name)
        return self._get(start - self.base, size)

    def drop_blob(self) -> None:
        """Forget the in-memory copy of a small archive (reads go back to the file)."""
        self._blob = None

    def pread(self, offset: int, n: int) -> bytes:
        """`n` bytes at absolute file `offset`, from memory for a small archive."""
        blob = self._blob
        if blob is not None and self.base <= offset and offset + n <= self.base + self.length:
            return blob[offset - self.base : offset - self.base + n]
        return self.file.pread(offset, n)

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill `buf` from absolute file `offset`, from memory for a small archive."""
        n = buf.nbytes
        blob = self._blob
        if blob is not None and self.base <= offset and offset + n <= self.base + self.length:
            buf[:] = blob[offset - self.base : offset - self.base + n]
            return
        self.file.readinto(offset, buf)

    # -- tensors ------------------------------------------------------------------

    def storage_range(self, t: TensorRef, name: str) -> tuple[int, int]:
        """(file offset, size) of `t`'s storage, checked to hold `t`'s elements."""
        s: StorageRef = t.storage
        itemsize = t.dtype.itemsize
        if itemsize is None:
            raise XckptError(f"{self.where}, tensor {name!r}: dtype torch.{t.dtype.name} is not supported by xckpt")
        start, size = self.data_range(f"{self.prefix}/data/{s.key}")
        want = s.numel if s.dtype is None else s.numel * (s.dtype.itemsize or 0)
        if s.dtype is not None and s.dtype != t.dtype:
            raise self._bad(f"tensor {name!r} of dtype {t.dtype!r} sits on a {s.dtype!r} storage")
        if size != want:
            raise self._bad(f"storage {s.key!r} holds {size} bytes, its pickle says {want}")
        if math.prod(t.size):
            last = t.offset + sum((n - 1) * st for n, st in zip(t.size, t.stride))
            if (last + 1) * itemsize > size:
                raise self._bad(
                    f"tensor {name!r} (offset {t.offset}, size {t.size}, stride {t.stride}) reaches "
                    f"past its storage {s.key!r} of {size} bytes"
                )
            # Zero strides (expanded views) make a tensor larger than its storage; bound the
            # claim so a crafted file cannot make a reader allocate without limit.
            logical = math.prod(t.size) * itemsize
            if logical > max(_EXPAND_LIMIT, 64 * size):
                raise self._bad(
                    f"tensor {name!r} claims {logical} bytes from a storage of {size} bytes (an "
                    "expanded view); re-save it with .contiguous() (clone) before torch.save"
                )
        return start, size


def zip_length(tail: bytes) -> int | None:
    """The length of the zip whose last bytes are `tail`, from its end records (None if they
    are not there). The end-of-central-directory record ends the file (after its comment), and
    sits right after the central directory, or after the zip64 end record and its locator."""
    pos = Archive._find_eocd(tail)
    if pos is None:
        return None
    _, _, _, _, _, cd_size, cd_off, clen = _EOCD.unpack_from(tail, pos)
    if cd_size != 0xFFFFFFFF and cd_off != 0xFFFFFFFF:
        return cd_off + cd_size + _EOCD.size + clen
    at = pos - _LOC64.size
    if at < 0 or tail[at : at + 4] != b"PK\x06\x07":
        return None
    e64_off = _LOC64.unpack_from(tail, at)[2]
    rec = at - _EOCD64.size
    if rec < 0 or tail[rec : rec + 4] != b"PK\x06\x06" or struct.unpack_from("<Q", tail, rec + 4)[0] != _EOCD64.size - 12:
        return None
    return e64_off + _EOCD64.size + _LOC64.size + _EOCD.size + clen


def _zip64(extra: bytes, usize: int, csize: int, local: int, bad: Any) -> tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, p)
        if tag == 1:
            body = extra[p + 4 : p + 4 + n]
            vals = []
            for i in range(len(body) // 8):
                vals.append(struct.unpack_from("<Q", body, 8 * i)[0])
            it = iter(vals)
            try:
                if usize == 0xFFFFFFFF:
                    usize = next(it)
                if csize == 0xFFFFFFFF:
                    csize = next(it)
                if local == 0xFFFFFFFF:
                    local = next(it)
            except StopIteration:
                raise bad("zip64 extra field is too short") from None
            return usize, csize, local
        p += 4 + n
    if 0xFFFFFFFF in (usize, csize, local):
        raise bad("zip64 sizes without a zip64 extra field")
    return usize, csize, local


def _swap(raw: np.ndarray, itemsize: int, complex_: bool) -> np.ndarray:
    unit = itemsize // 2 if complex_ else itemsize
    if unit == 1:
        return raw
    return raw.view(f"<u{unit}").byteswap().view(np.uint8)


class StoredBytes(Protocol):
    """What `read_box` reads a storage from by absolute offset: an `Archive`, a
    plain file's bytes (DCP's safetensors items) or a span held in memory."""

    @property
    def big_endian(self) -> bool: ...

    def pread(self, offset: int, n: int) -> bytes | memoryview: ...

    def readinto(self, offset: int, buf: memoryview) -> None: ...


def read_box(
    archive: StoredBytes,
    t: TensorRef,
    start: int,
    slices: tuple[slice, ...],
    out: np.ndarray,
) -> int:
    """Copy `tensor[slices]` into `out` (its shape); returns the bytes read from the file.

    `start` is the storage's file offset (`Archive.storage_range`). Only
    the byte span between the box's first and last elements is read; a box that
    is one contiguous run lands straight in `out` when `out` is contiguous.
    """
    dtype = out.dtype
    itemsize = dtype.itemsize
    lo = [s.start for s in slices]
    sub = tuple(s.stop - s.start for s in slices)
    if 0 in sub:
        return 0
    stride = t.stride
    first = t.offset + sum(a * st for a, st in zip(lo, stride))
    last = t.offset + sum((a + n - 1) * st for a, n, st in zip(lo, sub, stride))
    span = (last - first + 1) * itemsize
    needed = math.prod(sub) * itemsize
    f = archive
    swap = archive.big_endian and itemsize > 1
    complex_ = dtype.kind == "c"
    if span == needed and _c_order(sub, stride):
        if not swap and out.flags.c_contiguous:
            f.readinto(start + first * itemsize, memoryview(out.reshape(-1).view(np.uint8)))
            return needed
        raw = np.frombuffer(f.pread(start + first * itemsize, span), np.uint8)
        if swap:
            raw = _swap(raw, itemsize, complex_)
        out[...] = raw.view(dtype).reshape(sub)
        return span
    runs = _runs(t.size, stride, sub, itemsize)
    if runs is not None and span > 2 * needed:
        # Row-major storage, box narrower than the rows: read each contiguous run.
        k, run_elems = runs
        tmp = np.empty(sub, dtype=dtype)
        flat = tmp.reshape(-1).view(np.uint8)
        run_bytes = run_elems * itemsize
        for i, idx in enumerate(np.ndindex(*sub[:k])):
            el = first + sum(j * st for j, st in zip(idx, stride))
            f.readinto(start + el * itemsize, memoryview(flat[i * run_bytes : (i + 1) * run_bytes]))
        if swap:
            flat[:] = _swap(flat.copy(), itemsize, complex_)
        out[...] = tmp
        return run_bytes * math.prod(sub[:k])
    raw = np.frombuffer(f.pread(start + first * itemsize, span), np.uint8)
    if swap:
        raw = _swap(raw.copy(), itemsize, complex_)
    # ml_dtypes' float8_e5m2 has no array-interface type string as_strided understands
    # ('<f1'): stride a same-width unsigned integer view, then view it as the dtype.
    plain = np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else dtype
    view = np.lib.stride_tricks.as_strided(
        raw.view(plain), shape=sub, strides=tuple(st * itemsize for st in stride), writeable=False
    )
    out[...] = view if plain is dtype else view.view(dtype)
    return span


class _Mem:
    """A tensor's storage span held in memory, read like a file (zero-copy views)."""

    def __init__(self, buf: bytearray, base: int, big_endian: bool) -> None:
        self.mv = memoryview(buf)
        self.base = base
        self.big_endian = big_endian

    def pread(self, offset: int, n: int) -> memoryview:
        return self.mv[offset - self.base : offset - self.base + n]

    def readinto(self, offset: int, buf: memoryview) -> None:
        buf[:] = self.mv[offset - self.base : offset - self.base + buf.nbytes]


def _span(t: TensorRef, slices: tuple[slice, ...], itemsize: int) -> tuple[int, int]:
    """(first element, bytes) of the storage span the box `slices` of `t` touches."""
    lo = [s.start for s in slices]
    first = t.offset + sum(a * st for a, st in zip(lo, t.stride))
    last = t.offset + sum((s.stop - 1) * st for s, st in zip(slices, t.stride))
    return first, (last - first + 1) * itemsize


def read_boxes(
    reader: StoredBytes, t: TensorRef, start: int, items: list[tuple[tuple[slice, ...], np.ndarray]]
) -> None:
    """Several boxes of one tensor, each `out[...] = tensor[slices]`.

    When the boxes' byte spans add up to more than the tensor's whole span (column
    slices of row-major storage, as 8 devices sharding dim 1 ask), the tensor is read
    once, in slabs of rows of about `_SLAB` bytes, and every box is cut from
    memory; otherwise each box is read alone.
    """
    items = [(sl, out) for sl, out in items if out.size]
    if not items:
        return
    itemsize = items[0][1].dtype.itemsize
    whole = tuple(slice(0, n) for n in t.size)
    first, total = _span(t, whole, itemsize)
    if len(items) < 2 or sum(_span(t, sl, itemsize)[1] for sl, _ in items) <= total:
        for sl, out in items:
            read_box(reader, t, start, sl, out)
        return
    rows = t.size[0] if t.size else 1
    if t.size and total > _SLAB and t.stride[0] == max(t.stride):
        rows = max(1, _SLAB // max(1, t.stride[0] * itemsize))  # dim 0 outermost: slabs of rows
    for r0 in range(0, max(t.size[0], 1) if t.size else 1, rows):
        slab = (slice(r0, min(r0 + rows, t.size[0])),) + whole[1:] if t.size else ()
        lo, span = _span(t, slab, itemsize)
        buf = bytearray(span)
        reader.readinto(start + lo * itemsize, memoryview(buf))
        mem = _Mem(buf, start + lo * itemsize, reader.big_endian)
        for sl, out in items:
            if not t.size:
                read_box(mem, t, start, sl, out)
                continue
            a, b = max(sl[0].start, slab[0].start), min(sl[0].stop, slab[0].stop)
            if a < b:
                part = out[a - sl[0].start : b - sl[0].start]
                read_box(mem, t, start, (slice(a, b),) + sl[1:], part)


def _c_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


_MIN_RUN = 64 << 10
_MAX_RUNS = 4096


def _runs(size: tuple[int, ...], stride: tuple[int, ...], sub: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """For row-major storage and a box of few large runs: (leading dims k, elements per run)."""
    if not _c_order(size, stride):
        return None
    k = len(sub) - 1
    while k > 0 and sub[k] == size[k]:
        k -= 1
    run = sub[k] * math.prod(size[k + 1 :])
    if math.prod(sub[:k]) > _MAX_RUNS or run * itemsize < _MIN_RUN:
        return None
    return k, run
