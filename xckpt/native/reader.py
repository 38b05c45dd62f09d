"""The xckpt format's reader: open a checkpoint, read boxes of tensors, numpy out.

[`open`][xckpt.open] accepts a checkpoint only when it is complete: `xckpt.json` when
present, else rank manifests 0..W-1 with one save_id, merged by
`xckpt.native.commit.read_rank_manifests` (which also says which save is read).
Every tensor's chunks must tile it exactly. All of this is checked from the
manifests alone, before any chunk is opened or any output allocated. Before an output is
sized from the manifest ([`Checkpoint.read`][xckpt.native.reader.Checkpoint.read], [`Checkpoint.read_all`][xckpt.native.reader.Checkpoint.read_all]),
the claimed chunk sizes are checked against what storage holds: each array
chunk's zarr metadata and each packed byte range against its packed array.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from xckpt._progress import progress
from xckpt.errors import (
    CorruptChunkError,
    ManifestError,
    ObjectError,
    XckptError,
)
from xckpt.layout import Box, box_from_index
from xckpt.manifest import (
    Chunk,
    Manifest,
    ObjectEntry,
    decode_value,
)
from xckpt.native import _fileio, _packedio
from xckpt.native._deltas import Patches
from xckpt.native._refs import Resolver
from xckpt.native._units import PlanColumns, packed_sizes
from xckpt.native._zarr import NativeStorage, packed_grid
from xckpt.native.commit import read_rank_manifests, validate
from xckpt.source import ChunkRead, Source, UnitColumns, whole_request
from xckpt.storage import Location, corrupt, storage_error

__all__ = ["Checkpoint"]

#: verify(): packed byte ranges closer than this are fetched in one read.
_COALESCE_GAP = 1 << 20
#: Packed reads: the block of zarr chunks one span stays inside (a tensor crossing blocks
#: is read in parts), and, through tensorstore, bytes read ahead of the checks and copies out.
_PACKED_SPAN = 8 << 20
_PACKED_INFLIGHT = 64 << 20
#: verify(): bytes read per request, and bytes in flight at once.
_VERIFY_SLAB = 32 << 20
_VERIFY_INFLIGHT = 256 << 20


def _packed_at(c: Chunk) -> int:
    """A packed chunk's byte offset in its rank's packed array (recorded for every packed
    chunk: the manifest is refused on read without it)."""
    off = c.byte_offset
    if off is None:
        raise ManifestError(f"packed chunk {c.key!r} at {c.offset} has no byte_offset; the manifest is corrupt")
    return off


def _trail(c: Chunk) -> int:
    """4 for a packed chunk whose crc32 the manifest leaves out (a version 6 grid's cell):
    it is the 4 bytes after the chunk's own, read with them; else 0."""
    return 4 if c.crc32 is None else 0


def _packed_end(c: Chunk) -> int:
    """The end of a packed chunk's bytes in its packed array, with its crc32 where it is read from there."""
    return _packed_at(c) + c.nbytes + _trail(c)


def _crc_ok(raw: Any, c: Chunk) -> bool:
    """Whether packed chunk `c`'s bytes `raw` (followed by their crc32 where the manifest
    does not give it, `_trail`) pass their crc32 check."""
    if c.crc32 is not None:
        return _fileio.crc32(raw) == c.crc32
    n = c.nbytes
    return len(raw) == n + 4 and _fileio.crc32(raw[:n]) == int.from_bytes(raw[n:], "little")


def _fills_whole(job: ChunkRead) -> bool:
    """Whether a packed `job` fills all of a C-contiguous output with its whole chunk."""
    _name, c, req, out = job
    return (req is None or req.box.shape == c.shape == out.shape) and out.flags.c_contiguous


class _SpannedChunk:
    """A packed chunk in several spans: its job, the spans still to copy their part
    (`left`) into `whole`: its output's bytes (a whole, C-contiguous output) or a
    buffer of its own."""

    __slots__ = ("job", "left", "lock", "whole", "into_out")

    def __init__(self, job: ChunkRead, spans: int, lock: threading.Lock) -> None:
        self.job, self.left, self.lock = job, spans, lock
        self.into_out = _fills_whole(job) and not _trail(job.chunk)  # (a crc32 after the bytes: no room in out)
        self.whole = (
            job.out.reshape(-1).view(np.uint8) if self.into_out
            else np.empty(job.chunk.nbytes + _trail(job.chunk), np.uint8)
        )


def _job_of(item: Any) -> ChunkRead:
    return item.job if type(item) is _SpannedChunk else item


class Checkpoint(Source):
    """An xckpt checkpoint opened for reading: the format's [`Source`][xckpt.source.Source].

    Cheap to open (manifests only). Tensors are read by box; nothing else is read.
    """

    format = "xckpt"

    def __init__(self, path: Location, *, context: Any = None, manifest: Manifest | None = None) -> None:
        """Open `path`; with `manifest` (already read and validated by the caller, as the
        checkpoint manager merges a local step's rank manifests from several copies), its
        data is read from `path` and no manifest is read there."""
        self.storage = NativeStorage(path, context)
        self.path = self.storage.path
        data = None if manifest is not None else self.storage.read_key("xckpt.json")
        if manifest is not None:
            m = manifest
        elif data is not None:
            m = Manifest.loads(data, f"{self.path}/xckpt.json")
            if m.rank is not None:
                raise ManifestError(f"{self.path}/xckpt.json has rank {m.rank}; expected null")
            validate(m, self.path)
        else:
            m = read_rank_manifests(self.storage)
        self.manifest = m
        self._entries = m.tensors  # names, info and `in` read it (Source)
        self._arrays: dict[str, Any] = {}
        self._packed_stores: dict[str, Any] = {}
        self._verified_arrays: dict[str, Any] = {}
        self._checked: set[str] = set()
        self._packed_size_cache: dict[str, int] | None = None
        self._columns: PlanColumns | None = None
        #: A local directory: "plain" ranks are read with direct file I/O (xckpt.native._fileio).
        self._root = _fileio.local_root(self.storage.url)
        #: Where each array chunk's bytes are (its rank's codec; another step's, for a reference).
        self._where_of = Resolver(self.storage, m, context)
        self._patches = Patches(self.storage, context)
        self._packed_stored: dict[str, tuple[int, int, str] | None] = {}

    # -- metadata -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def save_id(self) -> str:
        return self.manifest.save_id

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.manifest.metadata

    # -- tensors ------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        """Every direct read (array chunks, then packed spans) starts before any is waited
        on, so packed small tensors are read while the large chunks are; tensorstore reads
        run meanwhile. Nothing still writes into an output when this returns or raises."""
        direct: list[ChunkRead] = []
        through_ts: list[ChunkRead] = []
        packed_jobs: dict[str, list[ChunkRead]] = defaultdict(list)
        for job in jobs:
            if job.chunk.form == "packed":
                packed_jobs[job.chunk.key].append(job)
            else:
                job = job if job.req is not None else job._replace(req=whole_request(job.chunk))
                (direct if self._direct_chunk(job.chunk) else through_ts).append(job)
        files = [(job, _fileio.submit_read(*self._file_read(job))) for job in direct] if direct else []
        spans: list[tuple[ChunkRead, Any]] = []
        err: BaseException | None = None
        try:
            through_ts_packed = []
            for key, pj in packed_jobs.items():
                meta = self._packed_meta(key, pj[0].chunk.rank) if self._direct(pj[0].chunk.rank) else None
                if meta is None:
                    through_ts_packed.append((key, pj))
                else:
                    spans += self._submit_packed(key, pj, meta)
            self._read_arrays(through_ts, bar)
            for key, pj in through_ts_packed:
                self._read_packed_store(key, pj, bar)
        except BaseException as e:  # raised below, once the direct reads have stopped
            err = e
        waits = [(job, fut, "") for job, fut in files]
        waits += [(job, fut, " (packed)") for job, fut in spans]
        for (name, c, _req, _out), fut, what in waits:
            try:
                n = fut.result()
            except (_fileio.ChunkFileError, OSError) as e:
                err = err or self._read_error(e, f"tensor {name!r}, chunk {c.box} ({c.key}){what}")
            except Exception as e:  # a packed tensor's own crc32 check, raised on its read thread
                err = err or e
            else:
                bar.update(n if what else n.nbytes)
        if err is not None:
            raise err
        if self.manifest.deltas:  # row deltas over the bases just read (format version 6)
            self._apply_deltas(direct + through_ts)

    def _apply_deltas(self, jobs: Sequence[ChunkRead]) -> None:
        deltas = self.manifest.deltas
        self._patches.load_all([
            (p, c.shape[0], c.shape[1], self.info(name).dtype) for name, c, _r, _o in jobs for p in deltas.get(c.key, ())
        ])
        for name, c, req, out in jobs:
            chain = deltas.get(c.key)
            if chain and req is not None:
                self._patches.apply(chain, c.shape, self.info(name).dtype, req.chunk_slices, req.target_view(out))

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """A packed chunk is one read of its bytes; an array chunk reads every inner zarr
        chunk the box touches, each stored whole (edge chunks padded) with a 4-byte crc32c."""
        if chunk.form == "packed":
            span = packed_grid(self._packed_sizes()[chunk.key])
            first, last = _packed_at(chunk) // span, (_packed_end(chunk) - 1) // span
            return {(chunk.key, i): span + 4 for i in range(first, last + 1)}
        grid = chunk.grid or chunk.shape
        cell = math.prod(grid) * itemsize + 4
        key = chunk.key
        if len(grid) == 2:  # (spelled out: a plan of 3,000 ranks asks this a million times)
            (o0, o1), (s0, s1), (c0, c1), (g0, g1) = box.offset, box.shape, chunk.offset, grid
            r1 = range((o1 - c1) // g1, (o1 - c1 + s1 - 1) // g1 + 1)
            return {(key, (i, j)): cell for i in range((o0 - c0) // g0, (o0 - c0 + s0 - 1) // g0 + 1) for j in r1}
        ranges = [
            range((o - co) // g, (o - co + s - 1) // g + 1)
            for o, s, co, g in zip(box.offset, box.shape, chunk.offset, grid)
        ]
        return {(key, idx): cell for idx in itertools.product(*ranges)}

    def read_units_columns(self, name: str, lo: np.ndarray, hi: np.ndarray, itemsize: int) -> UnitColumns | None:
        """`read_units` of many boxes of a grid tensor at once (`xckpt.native._units`)."""
        if self._columns is None:
            self._columns = PlanColumns(self.manifest, self._packed_sizes())
        return self._columns.columns(self.info(name), lo, hi, itemsize)

    def _packed_sizes(self) -> dict[str, int]:
        """Bytes of each rank's packed array (the end of its last packed chunk)."""
        if self._packed_size_cache is None:
            self._packed_size_cache = packed_sizes(self.manifest, _packed_end)
        return self._packed_size_cache

    def _where(self, name: str, c: Chunk) -> str:
        return f"checkpoint {self.path!r}, tensor {name!r}, chunk {c.box} ({c.key}){self._where_of.describe(c)}"

    def _open(self, name: str, c: Chunk) -> Any:
        fut = self._arrays.get(c.key)
        if fut is None:
            t = self.manifest.tensors[name]
            w = self._where_of.where(c)
            fut = w.storage.open_array(w.key, w.kind, t.dtype, c.shape, c.grid or c.shape, w.codec)
            self._arrays[c.key] = fut
        return fut

    def _direct_chunk(self, c: Chunk) -> bool:
        """Whether array chunk `c` is files this process reads itself."""
        w = self._where_of.where(c)
        return w.root is not None and w.kind != "ocdbt"

    def _kind(self, rank: int) -> str:
        return self.manifest.storage.get(rank, "ocdbt")

    @property
    def _dir(self) -> str:
        """The checkpoint's local directory: direct file reads happen only where it has one."""
        if self._root is None:
            raise XckptError(f"checkpoint {self.path!r} is not a local directory: its files cannot be read directly")
        return self._root

    def _direct(self, rank: int) -> bool:
        """Whether rank `rank`'s chunks are files this process reads itself."""
        return self._root is not None and self._kind(rank) != "ocdbt"

    def _read_error(self, e: Exception, what: str) -> XckptError:
        """A direct read failed: damaged data (CorruptChunkError) or storage (StorageError)."""
        if isinstance(e, _fileio.ChunkFileError):
            return corrupt(f"checkpoint {self.path!r}, {what}", e)
        err = storage_error(self.path, f"reading {what}", e)
        err.__cause__ = e
        return err

    def _raise_read_error(self, e: Exception, what: str) -> NoReturn:
        raise self._read_error(e, what) from (None if isinstance(e, _fileio.ChunkFileError) else e)

    def _file_read(self, job: ChunkRead) -> tuple[str, _fileio.ChunkRead]:
        """The directory and direct read of an array chunk job (`job.req` set)."""
        c, req = job.chunk, job.req
        if req is None:  # _read_chunks sets it; this keeps the type exact
            req = whole_request(c)
        w = self._where_of.where(c)
        return w.root or self._dir, _fileio.ChunkRead(
            w.key, c.shape, c.grid or c.shape, req.chunk_slices, req.target_view(job.out), w.kind, w.codec
        )

    def _read_arrays(self, jobs: list[ChunkRead], bar: Any) -> None:
        """Array chunks through tensorstore (OCDBT ranks, or a location that is not a local directory)."""
        opened = [(job, self._open(job[0], job[1])) for job in jobs]
        writes = []
        for (name, c, req, out), fut in opened:
            req = req or whole_request(c)
            try:
                src = fut.result()[req.chunk_slices]
            except ValueError as e:
                raise corrupt(self._where(name, c), e) from None
            # tensorstore decodes straight into the caller's buffer: no extra copy.
            writes.append((name, c, req, out.itemsize, self.storage.wrap(req.target_view(out)).write(src)))
        for name, c, req, itemsize, fut in writes:
            try:
                fut.result()
            except ValueError as e:
                raise corrupt(self._where(name, c), e) from None
            bar.update(req.box.volume * itemsize)

    def _packed_meta(self, key: str, rank: int) -> tuple[int, int, str] | None:
        """(bytes, zarr chunk length, storage kind) of a "plain"/"files" rank's packed array from
        its zarr.json, read directly; None when its layout is not one `xckpt.native._fileio`
        reads (tensorstore reads it then)."""
        if key not in self._packed_stored:
            try:
                meta = _fileio.stored_meta(self._dir, key)
            except (_fileio.ChunkFileError, OSError) as e:
                self._raise_read_error(e, f"packed chunks of rank {rank} ({key})")
            shape = meta.get("shape")
            grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape") if isinstance(
                meta.get("chunk_grid"), dict) else None
            if not (
                isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0
                and isinstance(grid, list) and len(grid) == 1 and type(grid[0]) is int and grid[0] > 0
            ):
                raise corrupt(
                    f"checkpoint {self.path!r}, packed chunks of rank {rank} ({key})",
                    ValueError(f"zarr.json shape {shape!r} / chunk shape {grid!r} is not one length each"),
                )
            layout = _fileio.parse_meta(meta)
            ok = layout is not None and layout[1] == "uint8" and len(layout[2]) == 1
            self._packed_stored[key] = (layout[2][0], layout[3][0], layout[0]) if layout is not None and ok else None
        return self._packed_stored[key]

    def _packed_store(self, key: str, rank: int) -> Any:
        """Rank `rank`'s packed byte array (opened once; its size from its zarr.json)."""
        store = self._packed_stores.get(key)
        if store is None:
            try:
                store = self.storage.open_packed(key, self.manifest.storage.get(rank, "ocdbt")).result()
            except ValueError as e:
                raise corrupt(f"checkpoint {self.path!r}, packed chunks of rank {rank} ({key})", e) from None
            self._packed_stores[key] = store
        return store

    def _packed_spans(self, jobs: list[ChunkRead], size: int, grid: int) -> list[tuple[int, int, list[Any]]]:
        """`jobs` (packed chunks of one array) as spans of zarr chunks
        (`xckpt.native._packedio.plan_spans`): `(first, stop, items)`, an item a job, or
        for a tensor in several spans one `_SpannedChunk` they share."""
        jobs.sort(key=lambda j: _packed_at(j[1]))
        ranges = []
        for job in jobs:
            c = job[1]
            start, end = _packed_at(c), _packed_end(c)
            if end > size:
                raise CorruptChunkError(
                    f"{self._where(job[0], c)}: bytes [{start}, {end}) lie past the end of the packed "
                    f"array ({size} bytes)"
                )
            ranges.append((start, end))
        spans = _packedio.plan_spans(ranges, grid, _PACKED_SPAN)
        parts = [0] * len(jobs)
        for _first, _stop, held in spans:
            for i in held:
                parts[i] += 1
        lock = threading.Lock()
        items: list[Any] = [_SpannedChunk(job, n, lock) if n > 1 else job for job, n in zip(jobs, parts)]
        return [(first, stop, [items[i] for i in held]) for first, stop, held in spans]

    def _submit_packed(
        self, key: str, jobs: list[ChunkRead], meta: tuple[int, int, str]
    ) -> list[tuple[ChunkRead, Any]]:
        """Start the direct reads of packed `jobs` (see `xckpt.native._packedio`): one task
        per span, which checks and copies out its tensors on the read thread."""
        size, grid, kind = meta
        spans = self._packed_spans(jobs, size, grid)
        try:
            arr = _packedio.open_packed(self._dir, key, size, grid, kind)
        except (_fileio.ChunkFileError, OSError) as e:
            self._raise_read_error(e, f"packed chunks of rank {jobs[0][1].rank} ({key})")
        unpack = functools.partial
        return [
            (_job_of(items[0]), _packedio.submit_span(arr, first, stop, unpack(self._unpack, first * grid, items)))
            for first, stop, items in spans
        ]

    def _read_packed_store(self, key: str, jobs: list[ChunkRead], bar: Any) -> None:
        """Packed `jobs` through tensorstore, span by span, `_PACKED_INFLIGHT` bytes
        read ahead of the checks and copies (the buffers held stay bounded)."""
        store = self._packed_store(key, jobs[0][1].rank)
        size = store.shape[0]
        grid = packed_grid(size)
        inflight: list[tuple[int, list[Any], Any]] = []
        held = 0
        for first, stop, pieces in self._packed_spans(jobs, size, grid):
            while inflight and held + (stop - first) * grid > _PACKED_INFLIGHT:
                held -= self._unpack_store(inflight.pop(0), grid, bar)
            inflight.append((first, pieces, store[first * grid : min(stop * grid, size)].read()))
            held += (stop - first) * grid
        for done in inflight:
            self._unpack_store(done, grid, bar)

    def _unpack_store(self, done: tuple[int, list[Any], Any], grid: int, bar: Any) -> int:
        first, items, fut = done
        try:
            buf = fut.result()
        except ValueError as e:
            name, c = _job_of(items[0])[:2]
            raise corrupt(f"{self._where(name, c)} (packed)", e) from None
        bar.update(self._unpack(first * grid, items, buf))
        return buf.nbytes

    def _unpack(self, base: int, items: list[Any], data: np.ndarray) -> int:
        """Check each packed chunk of a span (`data`: the packed bytes from `base` on)
        against its crc32 and copy it to its output; the bytes filled. A tensor in several
        spans (a `_SpannedChunk`) is assembled first, and checked and copied out by the
        span that completes it. Runs on a read thread for direct reads."""
        mv, done, end = memoryview(data).cast("B"), 0, base + data.nbytes
        for item in items:
            if type(item) is _SpannedChunk:
                c = item.job[1]
                start = _packed_at(c)
                lo, hi = max(start, base), min(_packed_end(c), end)
                item.whole[lo - start : hi - start] = mv[lo - base : hi - base]
                with item.lock:
                    item.left -= 1
                    if item.left:
                        continue
                done += self._check_copy(item.job, memoryview(item.whole).cast("B"), item.into_out)
                continue
            # Per small tensor: a memoryview slice, its crc32, one memcpy (W2: 20,000 of them).
            c = item[1]
            o = c.byte_offset - base
            done += self._check_copy(item, mv[o : o + c.nbytes + _trail(c)], False)
        return done

    def _check_copy(self, job: ChunkRead, raw: memoryview, in_place: bool) -> int:
        """Check packed chunk `raw` (the bytes of `job.chunk`, and its crc32 where the
        manifest leaves it out) against its crc32 and copy it to `job.out` (unless it was
        assembled there, `in_place`); the bytes filled."""
        name, c, req, out = job
        if not _crc_ok(raw, c):
            raise CorruptChunkError(
                f"{self._where(name, c)}: packed bytes fail their crc32 check. The "
                "checkpoint is damaged: restore it from a copy or load an earlier one"
            )
        raw = raw[: c.nbytes]
        if _fills_whole(job):
            if not in_place:
                try:
                    memoryview(out).cast("B")[:] = raw  # the whole chunk: one memcpy
                except (TypeError, ValueError):  # ml_dtypes types have no buffer format
                    out.reshape(-1).view(np.uint8)[:] = raw
            return c.nbytes
        req = req or whole_request(c)
        src = np.frombuffer(raw, out.dtype).reshape(c.shape)
        req.target_view(out)[...] = src[req.chunk_slices]
        return req.box.volume * out.itemsize

    def _open_checked(self, name: str, c: Chunk) -> Any:
        """Like `_open`, but the stored zarr metadata is read and must match the manifest."""
        fut = self._verified_arrays.get(c.key)
        if fut is None:
            w = self._where_of.where(c)
            fut = w.storage.check_array(w.key, w.kind, self.info(name).dtype, c.shape, c.grid or c.shape, w.codec)
            self._verified_arrays[c.key] = fut
        return fut

    # -- claims against storage -------------------------------------------------

    def _check_stored(self, names: Sequence[str], box: Box | None = None) -> None:
        """Check the chunk sizes `names` claim against storage before anything is sized
        from them: each array chunk's zarr metadata (dtype, shape, grid) and each packed
        byte range against its packed array's stored size. With `box` (one name), only
        the chunks the box meets."""
        todo = [n for n in names if n not in self._checked]
        if not todo:
            return
        arrays = []
        files: list[tuple[str, Chunk]] = []
        sizes: dict[str, int] = {}  # per packed array (20,000 small tensors share one)
        for name in todo:
            t = self.info(name)
            chunks = t.chunks if box is None else [t.chunks[i] for i in t.chunk_index.find(box)]
            for c in chunks:
                if c.form == "packed":
                    size = sizes.get(c.key)
                    if size is None:
                        meta = self._packed_meta(c.key, c.rank) if self._direct(c.rank) else None
                        size = meta[0] if meta is not None else self._packed_store(c.key, c.rank).shape[0]
                        sizes[c.key] = size
                    if _packed_end(c) > size:
                        raise CorruptChunkError(
                            f"{self._where(name, c)}: the manifest claims bytes [{c.byte_offset}, "
                            f"{_packed_end(c)}) of the packed array, which holds {size} bytes; "
                            "the manifest does not belong to this data (restore the checkpoint from a copy)"
                        )
                elif self._direct_chunk(c):
                    files.append((name, c))
                else:
                    arrays.append((name, c, self._open_checked(name, c)))
        if files:  # zarr.json files read concurrently (a cold load opens each)
            _fileio.run_all(lambda nc: self._check_file_meta(*nc), files)
        for name, c, fut in arrays:
            try:
                fut.result()
            except ValueError as e:
                raise corrupt(f"{self._where(name, c)}: the stored array does not match the manifest", e) from None
        if box is None:
            self._checked.update(todo)

    def _check_file_meta(self, name: str, c: Chunk) -> None:
        """A directly read chunk's claim against storage: a "files" shard's size (one stat),
        a "plain" array's zarr.json (versions 1-2)."""
        w, grid = self._where_of.where(c), c.grid or c.shape
        try:
            if w.kind == "files":
                _fileio.check_shard(w.root or self._dir, w.key, self.info(name).np_dtype.itemsize, c.shape, grid, w.codec)
            else:
                _fileio.check_meta(w.root or self._dir, w.key, w.kind, self.info(name).dtype, c.shape, grid, w.codec)
        except _fileio.ChunkFileError as e:
            raise corrupt(f"{self._where(name, c)}: the stored array does not match the manifest", e) from None
        except OSError as e:
            raise storage_error(self.path, f"reading the metadata of {self._where(name, c)}", e) from e

    def _too_big(self, names: Sequence[str], err: MemoryError) -> XckptError:
        nbytes = sum(self.info(n).nbytes for n in names)
        return XckptError(
            f"checkpoint {self.path!r}: {len(names)} tensor(s) ({', '.join(names[:3])}) of {nbytes} bytes "
            "do not fit in memory; read them by box (read(name, index)) or into your own buffers "
            f"(read_into) ({err})"
        )

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole tensor, or the box selected by `index` (ints and unit-step slices);
        the claimed sizes are checked against storage before the output is allocated (those
        of the chunks the box meets)."""
        if index is None:
            self._check_stored([name])
        else:
            self._check_stored([name], box_from_index(self.info(name).shape, index))
        try:
            return super().read(name, index)
        except MemoryError as e:
            raise self._too_big([name], e) from None

    def read_all(
        self, names: Sequence[str] | None = None, *, show_progress: bool | None = None
    ) -> dict[str, np.ndarray]:
        """Whole tensors by name, read concurrently, after checking their claims against storage."""
        names = self.names() if names is None else list(names)
        self._check_stored(names)
        try:
            return super().read_all(names, show_progress=show_progress)
        except MemoryError as e:
            raise self._too_big(names, e) from None

    # -- verification ---------------------------------------------------------------

    def verify(self, *, show_progress: bool | None = None) -> list[str]:
        """Read every chunk and object once and check its checksum; the problems found.

        One pass over each packed array (in slabs of adjacent chunks) and over each
        array chunk (in slabs of whole inner zarr chunks), many reads in flight at
        once (up to `_VERIFY_INFLIGHT` bytes), with a progress bar.
        """
        problems: dict[tuple[str, tuple[int, ...]], str] = {}
        packed: dict[str, list[tuple[str, Chunk]]] = defaultdict(list)
        slabs: list[_Slab] = []
        total = 0
        for name in self.names():
            for c in self.info(name).chunks:
                total += c.nbytes
                if c.form == "packed":
                    packed[c.key].append((name, c))
                else:
                    slabs.extend(self._array_slabs(name, c))
        for key, items in packed.items():
            slabs.extend(self._packed_slabs(key, items, problems))
        with progress(total, "xckpt verify", show_progress) as bar:
            inflight: list[tuple[_Slab, Any]] = []
            held = 0
            for slab in slabs:
                while inflight and held + slab.nbytes > _VERIFY_INFLIGHT:
                    done, fut = inflight.pop(0)
                    done.check(self, fut, problems)
                    held -= done.nbytes
                    bar.update(done.nbytes)
                inflight.append((slab, slab.start(self)))
                held += slab.nbytes
            for done, fut in inflight:
                done.check(self, fut, problems)
                bar.update(done.nbytes)
        return list(problems.values()) + self._verify_objects() + self._verify_patches()

    def _verify_patches(self) -> list[str]:
        """Every row patch (format version 6) read whole: its crc32c and indices checked."""
        problems = []
        for name in self.names() if self.manifest.deltas else ():
            for c in self.info(name).chunks:
                for p in self.manifest.deltas.get(c.key, ()):
                    try:
                        self._patches.load(p, c.shape[0], c.shape[1], self.info(name).dtype)
                    except CorruptChunkError as e:
                        problems.append(f"tensor {name!r}, chunk {c.box}: {e}")
        return problems

    def _array_slabs(self, name: str, c: Chunk) -> list[_Slab]:
        if not c.shape:
            return [_Slab(name, c, None, 0, 0, c.nbytes)]
        row_bytes = c.nbytes // c.shape[0]
        grid0 = max(1, (c.grid or c.shape)[0])
        step = grid0 * max(1, _VERIFY_SLAB // max(1, grid0 * row_bytes))
        return [
            _Slab(name, c, None, lo, min(lo + step, c.shape[0]), (min(lo + step, c.shape[0]) - lo) * row_bytes)
            for lo in range(0, c.shape[0], step)
        ]

    def _packed_slabs(
        self, key: str, items: list[tuple[str, Chunk]], problems: dict[tuple[str, tuple[int, ...]], str]
    ) -> list[_Slab]:
        try:
            store = self._packed_store(key, items[0][1].rank)
        except CorruptChunkError as e:
            for name, c in items:
                problems.setdefault((name, c.offset), f"{self._where(name, c)}: {e}")
            return []
        size = store.shape[0]
        items = sorted(items, key=lambda nc: _packed_at(nc[1]))
        out: list[_Slab] = []
        for name, c in items:
            start, end = _packed_at(c), _packed_end(c)
            if end > size:
                problems.setdefault(
                    (name, c.offset),
                    f"{self._where(name, c)}: bytes [{start}, {end}) lie past the end of the packed array "
                    f"({size} bytes)",
                )
                continue
            last = out[-1] if out else None
            if last is not None and last.span is not None and start - last.hi <= _COALESCE_GAP \
                    and end - last.lo <= _VERIFY_SLAB:
                last.hi = max(last.hi, end)
                last.nbytes = last.hi - last.lo
                last.span.append((name, c))
            else:
                out.append(_Slab(name, c, store, start, end, end - start, [(name, c)]))
        return out

    # -- objects ------------------------------------------------------------

    def _object_entries(self, name: str) -> list[ObjectEntry]:
        return [o for o in self.manifest.objects if o.name == name]

    def object_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for o in self.manifest.objects:
            seen.setdefault(o.name)
        return list(seen)

    def per_rank_objects(self) -> set[str]:
        return {o.name for o in self.manifest.objects if o.per_rank}

    # Source.objects applies the policy (names, per-rank, world size); these read values.

    def _object_value(self, name: str, rank: int | None) -> Any:
        entries = self._object_entries(name)
        if rank is None:
            return self._entry_value(entries[0])
        o = {o.rank: o for o in entries}.get(rank)
        if o is None:
            raise ObjectError(
                f"checkpoint {self.path!r}: per-rank object {name!r} has no value for rank {rank}"
            )
        return self._entry_value(o)

    def _per_rank_values(self, name: str) -> list[Any]:
        by_rank = {o.rank: o for o in self._object_entries(name)}
        return [self._entry_value(by_rank[r]) for r in sorted(by_rank)]

    def _entry_value(self, o: ObjectEntry) -> Any:
        if o.kind == "json":
            return decode_value(o.value, f"checkpoint {self.path!r}, object {o.name!r}")
        kind = self.manifest.storage.get(o.rank, "ocdbt")
        data = None if o.key is None else self.storage.read_bytes(o.key, kind)
        if data is None or len(data) != o.nbytes or _fileio.crc32(data) != o.crc32:
            raise CorruptChunkError(
                f"checkpoint {self.path!r}, object {o.name!r} ({o.key}): bytes are missing or fail "
                "their crc32 check; restore the checkpoint from a copy or load an earlier one"
            )
        return data

    def _verify_objects(self) -> list[str]:
        problems = []
        for o in self.manifest.objects:
            try:
                self._entry_value(o)
            except CorruptChunkError as e:
                problems.append(str(e))
        return problems


class _Slab:
    """One read of [`Checkpoint.verify`][xckpt.native.reader.Checkpoint.verify]: rows [lo, hi) of an array chunk, or bytes
    [lo, hi) of a packed array holding the chunks of `span`."""

    __slots__ = ("name", "chunk", "store", "lo", "hi", "nbytes", "span")

    def __init__(
        self, name: str, chunk: Chunk, store: Any, lo: int, hi: int, nbytes: int,
        span: list[tuple[str, Chunk]] | None = None,
    ) -> None:
        self.name, self.chunk, self.store, self.lo, self.hi = name, chunk, store, lo, hi
        self.nbytes, self.span = nbytes, span

    def start(self, ck: Checkpoint) -> Any:
        if self.span is not None:
            return self.store[self.lo : self.hi].read()
        c = self.chunk
        if ck._direct_chunk(c):
            grid, w = c.grid or c.shape, ck._where_of.where(c)
            root = w.root or ck._dir
            try:
                _fileio.check_meta(root, w.key, w.kind, ck.info(self.name).dtype, c.shape, grid, w.codec)
            except (_fileio.ChunkFileError, OSError) as e:
                return ValueError(str(e))
            region = (slice(self.lo, self.hi), *(slice(0, s) for s in c.shape[1:])) if c.shape else ()
            out = np.empty(tuple(r.stop - r.start for r in region), ck.info(self.name).np_dtype)
            return _fileio.submit_read(root, _fileio.ChunkRead(w.key, c.shape, grid, region, out, w.kind, w.codec))
        try:
            arr = ck._open_checked(self.name, self.chunk).result()
        except ValueError as e:
            return e
        return (arr[self.lo : self.hi] if self.chunk.shape else arr).read()

    def check(self, ck: Checkpoint, fut: Any, problems: dict[tuple[str, tuple[int, ...]], str]) -> None:
        name, c = self.name, self.chunk
        try:
            if isinstance(fut, ValueError):
                raise fut
            buf = fut.result()
        except (ValueError, OSError) as e:
            if self.span is None:
                problems.setdefault((name, c.offset), str(corrupt(ck._where(name, c), e)))
                return
            # A damaged zarr chunk under the span: find the chunks it holds, one by one.
            for n, pc in self.span:
                try:
                    raw = self.store[_packed_at(pc) : _packed_end(pc)].read().result()
                except ValueError as e2:
                    problems.setdefault((n, pc.offset), str(corrupt(f"{ck._where(n, pc)} (packed)", e2)))
                    continue
                if not _crc_ok(raw, pc):
                    problems.setdefault((n, pc.offset), f"{ck._where(n, pc)}: packed bytes fail their crc32 check")
            return
        for n, pc in self.span or ():
            raw = buf[_packed_at(pc) - self.lo : _packed_end(pc) - self.lo]
            if not _crc_ok(raw, pc):
                problems.setdefault(
                    (n, pc.offset),
                    f"{ck._where(n, pc)}: packed bytes fail their crc32 check. The checkpoint is damaged: "
                    "restore it from a copy or load an earlier one",
                )
