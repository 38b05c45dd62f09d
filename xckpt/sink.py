"""The write protocol: what every output format of `xckpt.convert` implements.

A [`Sink`][xckpt.sink.Sink] is the write side of one format, as a [`Source`][xckpt.source.Source]
is its read side; the formats table (`xckpt.formats.FORMATS`) holds one sink
per format beside its `detect` and `open`. The converter hands a sink a
[`WriteJob`][xckpt.sink.WriteJob]: everything is decided (names, objects, the temporary path); the
sink lays bytes out, reading the source through the job. The call protocol is in
[`Sink`][xckpt.sink.Sink]'s docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from xckpt._stream import Buffers, crc32c, read_ahead
from xckpt.errors import XckptError
from xckpt.layout import Box
from xckpt.manifest import Chunk, TensorEntry

if TYPE_CHECKING:  # sink and source are one layer, neither importing the other (a job only holds one)
    from xckpt.source import Source

__all__ = ["Sink", "WriteJob", "Progress", "BoxKey", "CONVERT_INFLIGHT_BYTES", "ReadOnlySink"]

#: Bytes the xckpt sink may hold in flight during a conversion.
CONVERT_INFLIGHT_BYTES = 32 << 20

#: Bytes of a band of rows `WriteJob.rows` gives of a large one-chunk tensor: read (and
#: converted by rules) into a buffer that stays in cache until it is written.
ROWS_BAND = 8 << 20

#: A source box: (tensor name, offset, shape).
BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]


class Progress(Protocol):
    """What a sink reports progress to (a tqdm bar, or a no-op)."""

    def update(self, n: int = 1) -> object:
        """`n` more tensor bytes have landed."""


class Sink(Protocol):
    """The write side of one output format: what `xckpt.convert` hands a checkpoint to.

    A sink keeps no state between calls: everything about one conversion is in the
    [`WriteJob`][xckpt.sink.WriteJob] it is handed, so the one instance in the formats table serves
    every conversion.

    Call protocol. `xckpt.convert` drives a conversion in one process, calling from
    one thread (the job reads the next piece on a background thread of its own while
    the sink writes the current one). Nothing is distributed: the sink sees every source
    writer's chunks, each with its writer as `chunk.rank`, and a format that can keep
    the source's layout (xckpt, torch DCP) writes one rank's pieces per `chunk.rank`.
    A parallel conversion (`xckpt.convert(..., workers=N)`, `xckpt.convert_parallel`)
    calls `check` the same way, then writes its parts through the formats' per-file
    writers, and `write` only for outputs of one part (one file, orbax), with
    `job.dst` a fixed sibling of the destination that a resumed run reuses.

    1. The driver opens the source (rules applied, `include`/`exclude` filtered),
       resolves its objects (pickled ones read with `allow_pickle`, else dropped with
       a warning), refuses a `dst` that holds a checkpoint without `overwrite`
       ([`CheckpointExistsError`][xckpt.errors.CheckpointExistsError]), and builds the [`WriteJob`][xckpt.sink.WriteJob].
       The sink may assume: `job.names` are tensors of `job.src`, in its order;
       `job.objects` are plain values (pickles already read or dropped);
       `job.dst` is a fresh hidden sibling of the destination that does not exist
       (nothing else writes there; its parent is made before step 3).
    2. `check(job)`, before anything exists at `job.dst`: from metadata alone (no
       tensor bytes read, nothing written) the sink raises
       [`XckptError`][xckpt.errors.XckptError] for what its format cannot hold (a dtype it has
       no name for, a name it cannot spell, two names that collide) and
       [`ObjectError`][xckpt.errors.ObjectError] for an object it can neither hold nor drop;
       it warns (`UserWarning`, naming them) about objects its format drops by design.
       Nothing is lost silently: an object `write` will not store was an error or a
       warning here.
    3. `write(job)`, once, after `check` passed, lays the checkpoint out at
       `job.dst` (a file or a directory it creates) and at no other path:

       * every tensor of `job.names` in full, and every object of `job.objects` that
         `check` did not announce as dropped (`job.per_rank_objects` hold every
         rank's value as a list, in rank order);
       * tensor bytes come only through the job ([`WriteJob.chunks`][xckpt.sink.WriteJob.chunks],
         [`bands`][xckpt.sink.WriteJob.bands], [`rows`][xckpt.sink.WriteJob.rows], [`tensor`][xckpt.sink.WriteJob.tensor]),
         which records the source's crc32c of every box for step 4; a sink never reads
         `job.src` for tensor data;
       * memory: the sink holds only the pieces it asked for; a recycled piece
         (`reuse=True`, a band, a row piece) is valid until the next one is asked for;
       * progress: `job.bar.update(nbytes)` as tensor bytes land; the updates of one
         `write` sum to the tensors' total `nbytes`;
       * completion: until `write` returns, nothing at `job.dst` is a checkpoint its
         format's reader (xckpt's, or the format's own library) accepts as complete: the
         step that completes it comes last, after the data it describes (an xckpt
         manifest; DCP's `.metadata`; orbax's tree metadata and `commit_success.txt`;
         a zip's central directory; a safetensors file's last byte, its header claiming
         every byte; a Hugging Face directory's last shard rename, its index naming
         shards still written as `.partial`);
       * on an error or interrupt the sink stops its own background work before the
         exception leaves `write`: nothing writes under `job.dst` afterwards.
    4. The driver, never the sink, then checks that `job.dst` exists and, with
       `verify`, reopens it through the same format's `open` (an output its own reader
       refuses fails the conversion), re-reads every box and compares its crc32c with the
       source's (`xckpt.convert.VerifyMismatchError`); then it renames `job.dst` into
       place, replacing an old checkpoint only now (`overwrite`). When step 2, 3 or 4
       raises, or the process is interrupted, the driver removes `job.dst` whole: a sink
       never cleans up, renames, or touches the destination.
    """

    #: The format's name, as the formats table lists it.
    format: str

    def check(self, job: WriteJob) -> None:
        """Step 2: refuse (raise) or announce (warn) what the format cannot hold; write nothing."""
        ...

    def write(self, job: WriteJob) -> None:
        """Step 3: lay the checkpoint out at `job.dst`, its completing piece last."""
        ...


@dataclass(frozen=True)
class WriteJob:
    """What a sink receives: everything is decided; it only lays bytes out.

    Attributes:
        src: the opened source (rules applied, names filtered).
        dst: a fresh local path (file or directory) that does not exist yet; the
            driver makes its parent before [`Sink.write`][xckpt.sink.Sink.write] and renames it into
            place afterwards.
        names: tensors to write, in source order.
        objects: objects to write (pickled ones already resolved or dropped).
        max_shard_size: bytes per shard of a safetensors Hugging Face directory (set by
            the driver only for one; None: the safetensors sink writes one file).
        bar: progress; sinks call `bar.update(nbytes)` as tensor bytes land.
        per_rank_objects: names in `objects` saved per rank; their value is the
            list of every rank's value, in rank order.
        compression: the codec of an xckpt output's array chunks (None: raw).
        record: record a crc32c per source box as it is read, for verify (the driver
            turns it off without verify, and for xckpt output, which checks its own).
        save_id: the id a format that records one (xckpt's manifests, DCP's `.metadata`)
            writes; the driver derives it from the source's fingerprint and the options, so
            converting the same source the same way gives the same bytes (None: random).
    """

    src: Source
    dst: str
    names: tuple[str, ...]
    objects: Mapping[str, Any]
    max_shard_size: int | None
    bar: Progress
    per_rank_objects: frozenset[str] = frozenset()
    record: bool = True
    compression: str | None = None
    save_id: str | None = None
    _buffers: Buffers = field(default_factory=Buffers, init=False, repr=False, compare=False)
    _crcs: dict[BoxKey, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _partial: dict[BoxKey, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: Each tensor's chunk ids by writer rank, found once (a sink asking for every rank's
    #: chunks in turn looks each rank up, never scans every chunk per rank).
    _by_rank: dict[str, Mapping[int, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def info(self, name: str) -> TensorEntry:
        """dtype, shape and chunk boxes of `name` in the source."""
        return self.src.info(name)

    @property
    def crcs(self) -> Mapping[BoxKey, int]:
        """crc32c of every source box read so far (with `record`): the driver's, for verify."""
        return self._crcs

    def _record(self, name: str, box: Box, arr: np.ndarray) -> None:
        if self.record:
            self._crcs[(name, tuple(box.offset), tuple(box.shape))] = crc32c(arr)

    def read_chunk(self, name: str, chunk: Chunk, *, reuse: bool = False) -> np.ndarray:
        """One stored chunk of `name`; records its crc32c for verify.

        The buffer is fresh, or with `reuse` one of two recycled ones (see `chunks`).
        """
        t = self.src.info(name)
        out = self._buffers.take(chunk.shape, t.np_dtype) if reuse else np.empty(chunk.shape, dtype=t.np_dtype)
        if out.size:
            self.src.read_into([(name, chunk.box, out)], show_progress=False)
        self._record(name, chunk.box, out)
        return out

    def chunks(
        self, name: str, *, rank: int | None = None, reuse: bool = False
    ) -> Iterator[tuple[Chunk, np.ndarray]]:
        """Each stored chunk of `name` (of writer `rank`, or all), in order.

        `chunk.box` is where it lies in the tensor, `chunk.rank` its source
        writer. Each buffer is fresh (a sink may keep it until it is written), or
        with `reuse` valid only until the next chunk is asked for: a sink that is
        done with each chunk by then (it wrote it synchronously) saves the kernel
        zeroing fresh pages for every chunk. The next chunk is read in the background
        meanwhile (two in memory).
        """
        t = self.src.info(name)
        if rank is None:
            chunks = list(t.chunks)
        else:
            ids = self._by_rank.get(name)
            if ids is None:
                ids = self._by_rank[name] = t.chunk_ids_by_rank
            chunks = [t.chunk(i) for i in ids.get(rank, ())]
        yield from read_ahead([functools.partial(self._chunk_pair, name, c, reuse) for c in chunks])
        if reuse:
            self._buffers.trim()

    def pieces(self, items: Sequence[tuple[str, Chunk]], *, reuse: bool = False) -> Iterator[tuple[str, Chunk, np.ndarray]]:
        """Each stored chunk of `items` (tensor name, chunk), in order, as `chunks`
        reads them (fresh buffers, or recycled ones with `reuse`; the next read ahead)."""
        yield from read_ahead([functools.partial(self._named_chunk, name, c, reuse) for name, c in items])
        if reuse:
            self._buffers.trim()

    def _named_chunk(self, name: str, chunk: Chunk, reuse: bool) -> tuple[str, Chunk, np.ndarray]:
        return name, chunk, self.read_chunk(name, chunk, reuse=reuse)

    def bands(
        self, name: str, *, max_bytes: int, multiple: int = 1
    ) -> Iterator[tuple[Chunk, tuple[int, ...], np.ndarray]]:
        """Each stored chunk of `name` in bands of whole rows: `(chunk, band offset, band)`.

        A band holds a multiple of `multiple` rows (at least that many) and about
        `max_bytes`; a chunk no larger than that comes whole. Bands are read one at a
        time into recycled buffers, each valid only until the next is asked for, the
        next read in the background meanwhile: memory stays near two bands whatever
        the source's chunks. The crc32c recorded for verify is the whole chunk's.
        """
        t = self.src.info(name)
        reads = []
        for c in t.chunks:
            if not c.box.volume:
                continue
            nbytes = c.box.volume * t.np_dtype.itemsize
            if len(c.shape) == 0 or nbytes <= max_bytes:
                reads.append(functools.partial(self._band, name, c, c.box, True))
                continue
            row = nbytes // c.shape[0]
            rows = max(multiple, (max_bytes // row) // multiple * multiple)
            for a in range(0, c.shape[0], rows):
                b = min(c.shape[0], a + rows)
                box = Box((c.offset[0] + a, *c.offset[1:]), (b - a, *c.shape[1:]))
                reads.append(functools.partial(self._band, name, c, box, b == c.shape[0]))
        yield from read_ahead(reads)
        self._buffers.trim()

    def _band(self, name: str, chunk: Chunk, box: Box, last: bool) -> tuple[Chunk, tuple[int, ...], np.ndarray]:
        out = self._buffers.take(box.shape, self.src.info(name).np_dtype)
        if out.size:
            self.src.read_into([(name, box, out)], show_progress=False)
        if self.record:  # bands of a chunk are read in order: its crc32c continues band by band
            key = (name, tuple(chunk.offset), tuple(chunk.shape))
            crc = crc32c(out, self._partial.pop(key, 0))
            if last:
                self._crcs[key] = crc
            else:
                self._partial[key] = crc
        return chunk, tuple(box.offset), out

    def _chunk_pair(self, name: str, chunk: Chunk, reuse: bool) -> tuple[Chunk, np.ndarray]:
        return chunk, self.read_chunk(name, chunk, reuse=reuse)

    def tensor(self, name: str, *, reuse: bool = False) -> np.ndarray:
        """The whole tensor (for outputs that cannot hold chunks); crc32c per source box.

        Fresh, or with `reuse` valid only until the next read through this job.
        """
        t = self.src.info(name)
        out = self._buffers.take(t.shape, t.np_dtype) if reuse else np.empty(t.shape, dtype=t.np_dtype)
        if out.size:
            self.src.read_into([(name, t.box, out)], show_progress=False)
        for c in t.chunks:
            self._record(name, c.box, out[c.box.slices()])
        return out

    def rows(self, name: str) -> Iterator[np.ndarray]:
        """The tensor's row-major bytes as C-contiguous pieces, in order.

        Pieces are bands of whole rows (dimension 0) that no source chunk
        crosses: a row-sharded tensor streams one chunk at a time, a
        column-sharded one comes as one piece, a large one-chunk tensor in
        bands of about `ROWS_BAND` bytes. Records a crc32c per source box;
        the next piece is read in the background while the caller writes one.
        A piece is valid only until the next is asked for (its buffer is reused).
        """
        t = self.src.info(name)
        chunks = [c for c in t.chunks if c.box.volume]
        if t.nbytes == 0:
            return
        whole = len(chunks) == 1 and chunks[0].box == t.box
        if len(t.shape) == 0 or (len(chunks) == 1 and not (whole and t.nbytes > 2 * ROWS_BAND and t.shape[0] > 1)):
            yield self.tensor(name, reuse=True)
            self._buffers.trim()
            return
        if whole:  # a large one-chunk tensor in bands of rows, each written while it is in cache
            for _, _, band in self.bands(name, max_bytes=ROWS_BAND):
                yield band
            return
        bands: list[list[Any]] = []  # [start, end, chunks]
        for c in sorted(chunks, key=lambda c: c.offset[0]):
            lo, hi = c.offset[0], c.offset[0] + c.shape[0]
            if bands and lo < bands[-1][1]:
                bands[-1][1] = max(bands[-1][1], hi)
                bands[-1][2].append(c)
            else:
                bands.append([lo, hi, [c]])
        reads: list[Callable[[], np.ndarray]] = []
        for lo, hi, members in bands:
            if len(members) == 1 and members[0].shape[1:] == t.shape[1:]:
                reads.append(functools.partial(self.read_chunk, name, members[0], reuse=True))
            else:
                box = Box((lo,) + (0,) * (len(t.shape) - 1), (hi - lo,) + tuple(t.shape[1:]))
                reads.append(functools.partial(self._read_band, name, box, members))
        yield from read_ahead(reads)
        self._buffers.trim()

    def _read_band(self, name: str, box: Box, members: list[Chunk]) -> np.ndarray:
        buf = self._buffers.take(box.shape, self.src.info(name).np_dtype)
        self.src.read_into([(name, box, buf)], show_progress=False)
        for c in members:
            self._record(name, c.box, buf[c.box.slices(box)])
        return buf


class ReadOnlySink:
    """The sink of a format xckpt reads but does not write (DeepSpeed, Megatron-Core):
    `check` refuses, naming the format and what to convert to instead; nothing is written."""

    def __init__(self, format: str, instead: str) -> None:  # noqa: A002
        self.format = format
        self._instead = instead

    def check(self, job: WriteJob) -> None:
        raise XckptError(
            f"xckpt reads {self.format} checkpoints but does not write them (output {job.dst!r}); {self._instead}"
        )

    def write(self, job: WriteJob) -> None:
        self.check(job)
