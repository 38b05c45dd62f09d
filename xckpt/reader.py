"""Framework-free read side: open a checkpoint, read boxes of tensors, numpy out.

:func:`open` accepts a checkpoint only when it is complete: ``xckpt.json`` when
present, else rank manifests 0..W-1 with one save_id, merged here. Every
tensor's chunks must tile it exactly. All of this is checked from the manifests
alone, before any chunk is opened or any output allocated.
"""

from __future__ import annotations

import os
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from xckpt._progress import progress
from xckpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    DtypeMismatchError,
    IncompleteCheckpointError,
    ManifestError,
    MissingEntryError,
    ObjectError,
    ShapeMismatchError,
)
from xckpt.layout import Box, box_from_index, check_coverage, plan_reads
from xckpt.manifest import (
    Chunk,
    Manifest,
    ObjectEntry,
    TensorEntry,
    decode_value,
    merge_manifests,
    paused_gc,
)
from xckpt.storage import Storage, corrupt

__all__ = ["Checkpoint", "open", "load", "read_rank_manifests"]

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


class Checkpoint:
    """A complete checkpoint opened for reading.

    Cheap to open (manifests only). Tensors are read by box; nothing else is read.
    """

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

    # -- metadata -----------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def save_id(self) -> str:
        return self.manifest.save_id

    def names(self) -> list[str]:
        """Tensor names in save order."""
        return list(self.manifest.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.manifest.tensors

    def info(self, name: str) -> TensorEntry:
        """dtype, shape, chunks, placement and value_range of a tensor."""
        t = self.manifest.tensors.get(name)
        if t is None:
            hint = " (it is an object: see objects())" if self._object_entries(name) else ""
            raise MissingEntryError(
                f"checkpoint {self.path!r} has no tensor {name!r}{hint}; it holds "
                f"{len(self.manifest.tensors)} tensors, e.g. {self.names()[:5]}"
            )
        return t

    # -- tensors ------------------------------------------------------------

    def read(self, name: str, index: Any = None) -> np.ndarray:
        """The whole tensor, or the box selected by ``index`` (ints and unit-step slices)."""
        t = self.info(name)
        box = box_from_index(t.shape, index)
        out = np.empty(box.shape, dtype=t.np_dtype)
        self.read_into([(name, box, out)])
        return out

    @paused_gc()
    def read_into(
        self,
        items: Iterable[tuple[str, Box, np.ndarray]],
        *,
        show_progress: bool | None = None,
    ) -> None:
        """Fill each ``out`` with box ``box`` of tensor ``name``; all reads run concurrently.

        Only chunks that overlap a box are read. ``out`` must have the box's shape
        and the saved dtype.
        """
        array_jobs: list[tuple[str, Chunk, Any, np.ndarray]] = []
        packed_jobs: dict[str, list[tuple[str, Chunk, Any, np.ndarray]]] = defaultdict(list)
        total = 0
        tensors = self.manifest.tensors
        for name, box, out in items:
            t = tensors.get(name)
            if t is None:
                t = self.info(name)  # raises MissingEntryError
            if out.dtype != t.np_dtype:
                raise DtypeMismatchError(
                    f"checkpoint {self.path!r}, tensor {name!r}: saved as {t.dtype}, target is "
                    f"{out.dtype}; load into a {t.dtype} tensor and cast after loading"
                )
            if out.shape != box.shape or not (box.shape == t.shape or t.box.contains(box)):
                raise ShapeMismatchError(
                    f"checkpoint {self.path!r}, tensor {name!r}: target box {box} (out shape "
                    f"{tuple(out.shape)}) does not fit the saved shape {t.shape}"
                )
            c = t.chunks[0] if len(t.chunks) == 1 else None
            if c is not None and c.form == "packed" and box.shape == t.shape and out.flags.c_contiguous:
                # A whole small tensor (the many-small-tensors case): one memcpy from the
                # packed bytes and no read planning (req None).
                packed_jobs[c.key].append((name, c, None, out))
                total += c.nbytes
                continue
            for req in plan_reads(t.boxes, box):
                c = t.chunks[req.chunk]
                job = (name, c, req, out)
                if c.form == "packed":
                    packed_jobs[c.key].append(job)
                else:
                    array_jobs.append(job)
                total += req.box.volume * out.itemsize
        with progress(total, "xckpt load", show_progress) as bar:
            self._read_arrays(array_jobs, bar)
            for key, jobs in packed_jobs.items():
                self._read_packed(key, jobs, bar)

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

    def _read_arrays(self, jobs: list[tuple[str, Chunk, Any, np.ndarray]], bar: Any) -> None:
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

    def _read_packed(self, key: str, jobs: list[tuple[str, Chunk, Any, np.ndarray]], bar: Any) -> None:
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

    @paused_gc()
    def read_all(self, names: Sequence[str] | None = None, *, show_progress: bool | None = None) -> dict[str, np.ndarray]:
        """Whole tensors by name, read concurrently."""
        names = self.names() if names is None else list(names)
        outs = {}
        items = []
        for n in names:
            t = self.info(n)
            outs[n] = np.empty(t.shape, dtype=t.np_dtype)
            items.append((n, t.box, outs[n]))
        self.read_into(items, show_progress=show_progress)
        return outs

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

    def objects(self, *, rank: int = 0, world_size: int | None = None, per_rank: str = "error") -> dict[str, Any]:
        """Non-tensor values by name.

        Replicated objects come back as saved. A per-rank object comes back as
        ``rank``'s value when ``world_size`` (default: the saved one) equals the
        saved world size; otherwise ``per_rank="list"`` returns every rank's
        value in rank order, and the default raises :class:`ObjectError`.
        """
        if per_rank not in ("error", "list"):
            raise ValueError("per_rank must be 'error' or 'list'")
        world = self.world_size if world_size is None else world_size
        out: dict[str, Any] = {}
        for name in self.object_names():
            entries = self._object_entries(name)
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

    # -- verification -------------------------------------------------------

    def verify(self) -> list[str]:
        """Read every chunk and object; a list of problems, empty when the checkpoint is sound."""
        problems: list[str] = []
        for name, t in self.manifest.tensors.items():
            for c in t.chunks:
                out = np.empty(c.shape, dtype=t.np_dtype)
                try:
                    self.read_into([(name, c.box, out)], show_progress=False)
                except CorruptChunkError as e:
                    problems.append(str(e))
        for o in self.manifest.objects:
            try:
                self._object_value(o)
            except CorruptChunkError as e:
                problems.append(str(e))
        return problems

    # -- notebook view --------------------------------------------------------

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        from xckpt import inspect

        return {"text/plain": inspect.text_table(self), "text/html": inspect.html_table(self)}

    def plot_layout(self, name: str, ax: Any = None) -> Any:
        """Chunk boxes of ``name`` coloured by writer rank (matplotlib Axes)."""
        from xckpt import inspect

        return inspect.plot_layout(self, name, ax)

    def plot_value_ranges(self, name: str, ax: Any = None) -> Any:
        """Key value ranges of ``name``'s chunks, for value-group tensors (matplotlib Axes)."""
        from xckpt import inspect

        return inspect.plot_value_ranges(self, name, ax)

    def __repr__(self) -> str:
        return (
            f"<xckpt.Checkpoint {self.path!r}: {len(self.manifest.tensors)} tensors, "
            f"{len(self.object_names())} objects, world_size {self.world_size}>"
        )


def open(path: str | os.PathLike[str], *, context: Any = None) -> Checkpoint:  # noqa: A001
    """Open a complete checkpoint for reading (manifests only; no chunk is read)."""
    return Checkpoint(path, context=context)


def load(path: str | os.PathLike[str], *, per_rank: str = "error", show_progress: bool | None = None) -> dict[str, Any]:
    """Every tensor (numpy) and object of a checkpoint, by name, in one process."""
    ck = open(path)
    out: dict[str, Any] = dict(ck.read_all(show_progress=show_progress))
    out.update(ck.objects(world_size=1 if per_rank == "error" else None, per_rank=per_rank))
    return out
