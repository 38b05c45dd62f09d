"""The xckpt format's reader: open a checkpoint, read boxes of tensors, numpy out.

:func:`open` accepts a checkpoint only when it is complete: ``xckpt.json`` when
present, else rank manifests 0..W-1 with one save_id, merged here. Every
tensor's chunks must tile it exactly. All of this is checked from the manifests
alone, before any chunk is opened or any output allocated.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from xckpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    IncompleteCheckpointError,
    ManifestError,
    ObjectError,
)
from xckpt.layout import Box, check_coverage
from xckpt.manifest import Chunk, Manifest, ObjectEntry, TensorEntry, decode_value, merge_manifests
from xckpt.source import ChunkRead, Source, whole_request
from xckpt.storage import Storage, corrupt, packed_grid

__all__ = ["Checkpoint", "read_rank_manifests", "validate"]

#: Packed byte ranges closer than this are fetched in one read.
_COALESCE_GAP = 1 << 20


def read_rank_manifests(
    storage: Storage,
    *,
    expect_world_size: int | None = None,
    expect_save_id: str | None = None,
) -> Manifest:
    """Read, check and merge ``ranks/0..W-1.json`` into one validated manifest."""
    where = storage.path
    keys = [k for k in storage.list_prefix("ranks/") if k.endswith(".json")]
    ranks = sorted(int(k[6:-5]) for k in keys if k[6:-5].isdigit())
    if not ranks:
        raise CheckpointNotFoundError(
            f"no xckpt checkpoint at {where!r}: neither xckpt.json nor ranks/<rank>.json exists"
        )
    datas = storage.read_keys([f"ranks/{r}.json" for r in ranks])
    parts: dict[int, Manifest] = {}
    for r, data in zip(ranks, datas):
        if data is None:
            continue
        parts[r] = Manifest.loads(data, f"{where}/ranks/{r}.json")
        if parts[r].rank != r:
            raise ManifestError(f"{where}/ranks/{r}.json says it is rank {parts[r].rank}")
    world = expect_world_size or max(m.world_size for m in parts.values())
    if expect_save_id is not None:
        save_id = expect_save_id
    else:
        # The save that rank 0 belongs to is the one being read.
        save_id = parts[0].save_id if 0 in parts else parts[min(parts)].save_id
    missing = [r for r in range(world) if r not in parts]
    stale = {r: m.save_id for r, m in parts.items() if r < world and m.save_id != save_id}
    other_w = {r: m.world_size for r, m in parts.items() if r < world and m.world_size != world}
    if missing or stale or other_w:
        bits = []
        if missing:
            bits.append(f"rank manifests missing: {missing}")
        if stale:
            bits.append(f"ranks {sorted(stale)} belong to another save ({stale}, expected {save_id!r})")
        if other_w:
            bits.append(f"ranks {sorted(other_w)} report world sizes {other_w}, expected {world}")
        raise IncompleteCheckpointError(
            f"checkpoint {where!r} of {world} ranks is incomplete: " + "; ".join(bits) + ". The "
            "save did not finish on every rank (or was overwritten part way); re-run the save, "
            "or load an earlier checkpoint"
        )
    merged = merge_manifests([parts[r] for r in range(world)], where)
    validate(merged, where)
    return merged


def validate(m: Manifest, where: str) -> None:
    """Check every tensor's chunks tile its shape exactly (LayoutError otherwise)."""
    for name, t in m.tensors.items():
        if len(t.chunks) == 1 and t.chunks[0].offset == (0,) * len(t.shape):
            if t.chunks[0].shape == t.shape:
                continue
        check_coverage(t.shape, [c.box for c in t.chunks], name=name, where=where)


class Checkpoint(Source):
    """An xckpt checkpoint opened for reading: the format's :class:`~xckpt.source.Source`.

    Cheap to open (manifests only). Tensors are read by box; nothing else is read.
    """

    format = "xckpt"

    def __init__(self, path: str | os.PathLike[str], *, context: Any = None) -> None:
        self.storage = Storage(path, context)
        self.path = self.storage.path
        data = self.storage.read_key("xckpt.json")
        if data is not None:
            m = Manifest.loads(data, f"{self.path}/xckpt.json")
            if m.rank is not None:
                raise ManifestError(f"{self.path}/xckpt.json has rank {m.rank}; expected null")
            validate(m, self.path)
        else:
            m = read_rank_manifests(self.storage)
        self.manifest = m
        self._arrays: dict[str, Any] = {}
        self._packed_size_cache: dict[str, int] | None = None

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

    def names(self) -> list[str]:
        """Tensor names in save order."""
        return list(self.manifest.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.tensors

    def info(self, name: str) -> TensorEntry:
        """dtype, shape, chunks, placement and value_range of a tensor."""
        t = self.manifest.tensors.get(name)
        if t is None:
            raise self._missing(name)
        return t

    # -- tensors ------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        array_jobs: list[ChunkRead] = []
        packed_jobs: dict[str, list[ChunkRead]] = defaultdict(list)
        for job in jobs:
            if job.chunk.form == "packed":
                packed_jobs[job.chunk.key].append(job)
            else:
                array_jobs.append(job if job.req is not None else job._replace(req=whole_request(job.chunk)))
        self._read_arrays(array_jobs, bar)
        for key, pj in packed_jobs.items():
            self._read_packed(key, pj, bar)

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """A packed chunk is one read of its bytes; an array chunk reads every inner zarr
        chunk the box touches, each stored whole (edge chunks padded) with a 4-byte crc32c."""
        if chunk.form == "packed":
            grid = packed_grid(self._packed_sizes()[chunk.key])
            first, last = chunk.byte_offset // grid, (chunk.byte_offset + chunk.nbytes - 1) // grid  # type: ignore[operator]
            return {(chunk.key, i): grid + 4 for i in range(first, last + 1)}
        grid = chunk.grid or chunk.shape
        cell = math.prod(grid) * itemsize + 4
        ranges = [
            range((o - co) // g, (o - co + s - 1) // g + 1)
            for o, s, co, g in zip(box.offset, box.shape, chunk.offset, grid)
        ]
        return {(chunk.key, idx): cell for idx in itertools.product(*ranges)}

    def _packed_sizes(self) -> dict[str, int]:
        """Bytes of each rank's packed array (the end of its last packed chunk)."""
        if self._packed_size_cache is None:
            sizes: dict[str, int] = {}
            for t in self.manifest.tensors.values():
                for c in t.chunks:
                    if c.form == "packed":
                        sizes[c.key] = max(sizes.get(c.key, 0), c.byte_offset + c.nbytes)  # type: ignore[operator]
            self._packed_size_cache = sizes
        return self._packed_size_cache

    def _where(self, name: str, c: Chunk) -> str:
        return f"checkpoint {self.path!r}, tensor {name!r}, chunk {c.box} ({c.key})"

    def _open(self, name: str, c: Chunk) -> Any:
        fut = self._arrays.get(c.key)
        if fut is None:
            t = self.manifest.tensors[name]
            fut = self.storage.open_array(
                c.key, self.manifest.storage.get(c.rank, "ocdbt"), t.dtype, c.shape, c.grid or c.shape
            )
            self._arrays[c.key] = fut
        return fut

    def _read_arrays(self, jobs: list[ChunkRead], bar: Any) -> None:
        opened = [(job, self._open(job[0], job[1])) for job in jobs]
        writes = []
        for (name, c, req, out), fut in opened:
            try:
                src = fut.result()[req.chunk_slices]
            except ValueError as e:
                raise corrupt(self._where(name, c), e) from None
            # tensorstore decodes straight into the caller's buffer: no extra copy.
            writes.append((name, c, req, out.itemsize, self.storage.wrap(out[req.target_slices]).write(src)))
        for name, c, req, itemsize, fut in writes:
            try:
                fut.result()
            except ValueError as e:
                raise corrupt(self._where(name, c), e) from None
            bar.update(req.box.volume * itemsize)

    def _read_packed(self, key: str, jobs: list[ChunkRead], bar: Any) -> None:
        rank = jobs[0][1].rank
        try:
            store = self.storage.open_packed(key, self.manifest.storage.get(rank, "ocdbt")).result()
        except ValueError as e:
            raise corrupt(f"checkpoint {self.path!r}, packed chunks of rank {rank} ({key})", e) from None
        jobs.sort(key=lambda j: j[1].byte_offset)  # type: ignore[arg-type, return-value]
        spans: list[list[Any]] = []  # [start, end, [jobs]]
        for job in jobs:
            c = job[1]
            start, end = c.byte_offset, c.byte_offset + c.nbytes  # type: ignore[operator]
            if spans and start - spans[-1][1] <= _COALESCE_GAP:
                spans[-1][1] = max(spans[-1][1], end)
                spans[-1][2].append(job)
            else:
                spans.append([start, end, [job]])
        size = store.shape[0]
        futs = []
        for start, end, span_jobs in spans:
            if end > size:
                c = span_jobs[-1][1]
                raise CorruptChunkError(
                    f"{self._where(span_jobs[-1][0], c)}: bytes [{c.byte_offset}, "
                    f"{c.byte_offset + c.nbytes}) lie past the end of the packed array ({size} bytes)"
                )
            futs.append(store[start:end].read())
        for (start, _end, span_jobs), fut in zip(spans, futs):
            try:
                buf = fut.result()
            except ValueError as e:
                raise corrupt(f"{self._where(span_jobs[0][0], span_jobs[0][1])} (packed)", e) from None
            for name, c, req, out in span_jobs:
                raw = buf[c.byte_offset - start : c.byte_offset - start + c.nbytes]
                if zlib.crc32(raw) != c.crc32:
                    raise CorruptChunkError(
                        f"{self._where(name, c)}: packed bytes fail their crc32 check. The "
                        "checkpoint is damaged: restore it from a copy or load an earlier one"
                    )
                if req is None or (req.box.shape == c.shape == out.shape and out.flags.c_contiguous):
                    out.reshape(-1).view(np.uint8)[:] = raw  # the whole chunk: one memcpy
                    bar.update(c.nbytes)
                else:
                    out[req.target_slices] = raw.view(out.dtype).reshape(c.shape)[req.chunk_slices]
                    bar.update(req.box.volume * out.itemsize)

    # -- objects ------------------------------------------------------------

    def _object_entries(self, name: str) -> list[ObjectEntry]:
        return [o for o in self.manifest.objects if o.name == name]

    def object_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for o in self.manifest.objects:
            seen.setdefault(o.name)
        return list(seen)

    def _object_value(self, o: ObjectEntry) -> Any:
        if o.kind == "json":
            return decode_value(o.value)
        data = self.storage.read_bytes(o.key, self.manifest.storage.get(o.rank, "ocdbt"))  # type: ignore[arg-type]
        if data is None or len(data) != o.nbytes or zlib.crc32(data) != o.crc32:
            raise CorruptChunkError(
                f"checkpoint {self.path!r}, object {o.name!r} ({o.key}): bytes are missing or fail "
                "their crc32 check; restore the checkpoint from a copy or load an earlier one"
            )
        return data

    def per_rank_objects(self) -> set[str]:
        return {o.name for o in self.manifest.objects if o.per_rank}

    def objects(
        self,
        names: Sequence[str] | None = None,
        *,
        rank: int = 0,
        world_size: int | None = None,
        per_rank: str = "error",
    ) -> dict[str, Any]:
        """Non-tensor values by name (all, or ``names``).

        Replicated objects come back as saved. A per-rank object comes back as
        ``rank``'s value when ``world_size`` (default: the saved one) equals the
        saved world size; otherwise ``per_rank="list"`` returns every rank's
        value in rank order, and the default raises :class:`ObjectError`.
        """
        if per_rank not in ("error", "list"):
            raise ValueError("per_rank must be 'error' or 'list'")
        world = self.world_size if world_size is None else world_size
        out: dict[str, Any] = {}
        for name in self.object_names() if names is None else names:
            entries = self._object_entries(name)
            if not entries:
                raise self._missing_object(name)
            if not entries[0].per_rank:
                out[name] = self._object_value(entries[0])
                continue
            by_rank = {o.rank: o for o in entries}
            if per_rank == "list":
                out[name] = [self._object_value(by_rank[r]) for r in sorted(by_rank)]
            elif world == self.world_size:
                if rank not in by_rank:
                    raise ObjectError(
                        f"checkpoint {self.path!r}: per-rank object {name!r} has no value for rank {rank}"
                    )
                out[name] = self._object_value(by_rank[rank])
            else:
                raise ObjectError(
                    f"checkpoint {self.path!r}: object {name!r} was saved per rank by "
                    f"{self.world_size} ranks and is loaded at world size {world}; there is no "
                    "rank-for-rank match. Ask for every rank's value with per_rank='list' and "
                    "choose"
                )
        return out

    def _verify_objects(self) -> list[str]:
        problems = []
        for o in self.manifest.objects:
            try:
                self._object_value(o)
            except CorruptChunkError as e:
                problems.append(str(e))
        return problems
