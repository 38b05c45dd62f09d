"""The manifest document: one rank's (or the merged) tensors, objects and storage, as JSON.

A manifest never holds framework types or pickles: only ints, strings, tuples
and JSON values. [`Manifest.from_json`][xckpt.manifest._document.Manifest.from_json] validates everything a reader relies
on (format and version, dtypes, shapes, chunk keys that stay inside the
checkpoint, byte counts that agree with the boxes) before anything is allocated
or opened, and raises [`ManifestError`][xckpt.errors.ManifestError] (or
[`FormatVersionError`][xckpt.errors.FormatVersionError]) naming the checkpoint and tensor.

Format (version 6), one JSON object:

    {"format": "xckpt", "version": 6, "save_id": "...", "world_size": W,
     "rank": r | null,                       # null in the merged xckpt.json
     "storage": {"<rank>": "files" | "plain" | "ocdbt"},  # how data/<rank>/ is organised
     "packed": {"<rank>": key},              # each rank's packed byte array (version 4)
     "dirs": {"<rank>": "data/<rank>.<token>"},  # data directories other than data/<rank> (5)
     "tensors": {name: {"dtype", "shape", "chunks": [chunk...],
                        "placement"?: {...}, "value_range"?: {...}}
                       | {"dtype", "shape", "grid": {...}, ...}   # a grid (version 5)
                       | [dtype, shape, rank, byte_offset, crc32]},   # a packed row
     "table": {...},                         # a rank manifest's one-chunk tensors as columns (6)
     "objects": [{"name", "kind": "json" | "bytes", "per_rank", "rank", ...}],
     "metadata": {...},
     "checksum": "sha256:<hex>"}           # last member, see below

`checksum` is the SHA-256 of the file's bytes with the checksum member removed
(the bytes up to `,"checksum"` followed by `}`): written last so a reader
checks the raw bytes without re-serialising anything. A manifest whose bytes fail
it, or a version-2 manifest without it, is a [`ManifestError`][xckpt.errors.ManifestError]
(a flipped byte can rename a tensor or drop every object; JSON alone cannot tell).
Version 1 (the same document without `checksum`) is still read. `tensors`,
`objects` and `storage` are required in every version. Version 3 adds the
storage kind `"files"`: plain zarr arrays whose chunk keys use the `.` separator
(`c.0.0`: one directory per array, not one per row of chunks; see
`xckpt.storage`); a version 2 reader would look for `c/0/0` and must refuse it.
Version 4 adds packed rows: a tensor whose one chunk is the whole tensor, packed
in its rank's byte array (`"packed"` names the array's key per rank), is the
array `[dtype, shape, rank, byte_offset, crc32]` instead of an entry object
(a third of the bytes: manifests of many small tensors parse and write about 4x
faster); a version 3 reader would reject the array, so the version says it. Version 5
adds grid entries (`xckpt.manifest._grids`): a tensor whose chunks form a rectilinear
grid over its writers is its split points, the writer of each cell by rule and its key
relative to the writer's data directory (`"dirs"`), not one chunk object per writer.
Version 6 writes a grid's columns (ranks, packed byte offsets and crc32s) as base64 strings
of little-endian integers instead of lists (`xckpt.manifest._grids`).

Limits come before allocation: every claim (number of dimensions, each extent, a
tensor's elements and bytes, world size, chunks per tensor, key and name lengths,
object nesting depth) is checked against the fixed bounds below while the JSON is
validated, before anything is sized from it; the reader then checks claims against
what storage holds before it allocates an output.

A chunk is `{"offset", "shape", "key", "rank", "nbytes"}` plus, for a chunk
packed into its rank's byte array, `"form": "packed", "byte_offset", "crc32"`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import orjson

from xckpt.errors import FormatVersionError, ManifestError
from xckpt.manifest._checks import (
    FORMAT,
    GRID_VERSION,
    INCREMENTAL_VERSION,
    MAX_KEY_LEN,
    MAX_NAME_LEN,
    MAX_WORLD_SIZE,
    READ_VERSIONS,
    STORAGE_KINDS,
    TABLE_VERSION,
    VERSION,
    _int,
    _str,
)
from xckpt.manifest._entries import Chunk, ObjectEntry, TensorEntry, paused_gc
from xckpt.manifest._grids import GridChunks, check_dirs
from xckpt.manifest._incremental import (
    Patch,
    Ref,
    check_codecs,
    check_deltas,
    check_hashes,
    check_refs,
    incremental_json,
)
from xckpt.manifest._rows import _packed_keys, _tensor_entries, _tensors_to_json
from xckpt.manifest._signed import _checksum_state, manifest_bytes
from xckpt.manifest._table import expand_table, table_json

__all__ = ["Manifest", "Header", "merge_manifests", "parse_document", "parse_header", "signed_header"]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """One rank's manifest (`rank` set) or the merged one (`rank is None`)."""

    save_id: str
    world_size: int
    rank: int | None
    tensors: Mapping[str, TensorEntry]
    objects: tuple[ObjectEntry, ...] = ()
    storage: Mapping[int, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    #: Data directories other than `data/<rank>` (an overwriting save's `data/<rank>.<token>`),
    #: by rank: what a grid's keys are relative to (version 5).
    dirs: Mapping[int, str] = field(default_factory=dict)
    #: Version 6 (`xckpt.manifest._incremental`): each rank's codec of its array chunks,
    #: arrays stored in another step of a manager root, and array chunks' BLAKE2b-128 hashes.
    codecs: Mapping[int, str] = field(default_factory=dict)
    refs: Mapping[str, Ref] = field(default_factory=dict)
    hashes: Mapping[str, str] = field(default_factory=dict)
    deltas: Mapping[str, tuple[Patch, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        table, listed = None, set[str]()
        if self.rank is not None and self.world_size > 1:  # a rank manifest of a save of several ranks
            table, listed = table_json(self.tensors, self.rank, self.dirs.get(self.rank, f"data/{self.rank}"))
        tensors, packed = _tensors_to_json(
            {n: t for n, t in self.tensors.items() if n not in listed} if listed else self.tensors
        )
        dirs = dict(self.dirs)
        for t in self.tensors.values():
            if isinstance(t.chunks, GridChunks):
                for r, d in t.chunks.dirs.items():
                    if dirs.setdefault(r, d) != d:
                        raise ManifestError(
                            f"tensor {t.name!r}: rank {r}'s data directory is both {dirs[r]!r} and {d!r}"
                        )
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "rank": self.rank,
            "storage": {str(r): s for r, s in sorted(self.storage.items())},
            "packed": {str(r): k for r, k in sorted(packed.items())},
            "tensors": tensors,
            **({"table": table} if table is not None else {}),
            "objects": [o.to_json() for o in self.objects],
            "metadata": dict(self.metadata),
        }
        if dirs:
            doc["dirs"] = {str(r): d for r, d in sorted(dirs.items())}
        doc.update(incremental_json(self.codecs, self.refs, self.hashes, self.deltas))
        return doc

    def dumps(self) -> bytes:
        """The manifest's bytes, checksum included."""
        return manifest_bytes(self.to_json())

    @classmethod
    @paused_gc()
    def loads(cls, data: bytes, where: str) -> Manifest:
        """Check the checksum, parse and validate; `where` names the file in error messages.

        Raises:
            ManifestError: not JSON, a failed or missing checksum, a missing field, a
                claim over the fixed bounds, or any malformed entry.
            FormatVersionError: another format, or a version this xckpt does not read.
        """
        return cls.from_json(parse_document(data, where), where)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Manifest:
        """Validate a parsed manifest document (the checksum is `loads`' business)."""
        try:
            h = parse_header(d, where)
            return cls(
                save_id=h.save_id,
                world_size=h.world_size,
                rank=h.rank,
                tensors=_tensor_entries(
                    h.tensors, h.packed, where, h.world_size, h.dirs if h.version >= GRID_VERSION else None,
                    h.version,
                ),
                objects=tuple(ObjectEntry.from_json(o, where) for o in h.objects),
                storage=h.storage,
                metadata=h.metadata,
                dirs=h.dirs,
                codecs=h.codecs,
                refs=h.refs,
                hashes=h.hashes,
                deltas=h.deltas,
            )
        except ManifestError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
            raise _malformed(e, where) from None

    def with_rank(self, rank: int | None) -> Manifest:
        return replace(self, rank=rank)


def _malformed(e: Exception, where: str) -> ManifestError:
    # Every field is checked on its own; this is the backstop for shapes of JSON
    # that no check foresaw, so a hostile manifest still ends in a ManifestError.
    return ManifestError(f"{where}: malformed manifest ({type(e).__name__}: {e})"[:400])


def parse_document(data: bytes, where: str) -> Any:
    """A manifest's bytes as JSON, its checksum checked (a ManifestError otherwise)."""
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ManifestError(
            f"{where} is not valid JSON ({e}); the file is truncated or corrupt. Re-save the "
            "checkpoint, or load an earlier one"
        ) from None
    state = _checksum_state(data)
    if state is False:
        raise ManifestError(
            f"{where} fails its checksum: the file is corrupt (a changed byte can rename a tensor "
            "or drop objects, so nothing of it is trusted). Restore it from a copy, or load an "
            "earlier checkpoint"
        )
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: a manifest must be a JSON object")
    if state is None and (d.get("version") != 1 or "checksum" in d):
        if d.get("format") == FORMAT and d.get("version") in READ_VERSIONS:
            raise ManifestError(
                f"{where} lacks its checksum (version {d.get('version')} manifests end with "
                '"checksum"): the file is corrupt or was edited. Restore it from a copy, or '
                "load an earlier checkpoint"
            )
    return d


class Header(NamedTuple):
    """A manifest document's members, checked, with its tensors and objects still raw JSON."""

    version: int
    save_id: str
    world_size: int
    rank: int | None
    storage: dict[int, str]
    packed: dict[int, str]
    dirs: dict[int, str]
    metadata: dict[str, Any]
    tensors: dict[str, Any]
    objects: list[Any]
    codecs: dict[int, str] = {}  # noqa: RUF012  (never mutated: a NamedTuple default)
    refs: dict[str, Ref] = {}  # noqa: RUF012
    hashes: dict[str, str] = {}  # noqa: RUF012
    deltas: dict[str, tuple[Patch, ...]] = {}  # noqa: RUF012
    #: The raw chunk table (`xckpt.manifest._table`), when asked to keep it (else its tensors are in `tensors`).
    table: Any = None


def signed_header(data: bytes, where: str) -> Header | None:
    """A manifest's header (`parse_header`, with no tensors and no objects), read from the
    members its writer puts before `"tensors"`, when its bytes pass their checksum: a
    listing of many manifests (a local tier's rank parts) needs only who wrote each, not
    their tensors (a 130 KB rank manifest: 0.1 ms instead of 1.8). None when the bytes
    are not signed or their head does not parse as one: `parse_document` of them then
    says what is wrong.

    Raises:
        ManifestError, FormatVersionError: the header's members fail `parse_header`'s checks.
    """
    if _checksum_state(data) is not True:
        return None
    end = data.find(b',"tensors":')
    if end < 0:
        return None
    try:
        d = orjson.loads(data[:end] + b"}")  # the members before "tensors" (a nested one would not parse)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(d, dict):
        return None
    d["tensors"], d["objects"] = {}, []
    return parse_header(d, where)


def parse_header(d: Any, where: str, *, keep_table: bool = False) -> Header:
    """Check a manifest document's format, version and every member but its tensors and objects.

    A rank manifest's chunk table (version 6) is expanded into `tensors` (before its
    entries), unless `keep_table`: then it stays raw in `Header.table`, for `RankMerge`."""
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: a manifest must be a JSON object")
    if d.get("format") != FORMAT:
        raise FormatVersionError(
            f"{where}: format is {d.get('format')!r}, not {FORMAT!r}; this is not an xckpt "
            "manifest"[:300]
        )
    if d.get("version") not in READ_VERSIONS or type(d.get("version")) is not int:
        raise FormatVersionError(
            f"{where}: format version {d.get('version')!r} is not supported by this xckpt "
            f"(it reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade xckpt to read it"[:400]
        )
    missing = [k for k in ("save_id", "world_size", "rank", "storage", "tensors", "objects") if k not in d]
    if missing:
        raise ManifestError(
            f"{where} lacks the required field{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))}: the file is corrupt or was not written by xckpt"
        )
    world_size = _int(d.get("world_size"), "world_size", where, lo=1, hi=MAX_WORLD_SIZE + 1)
    rank = d.get("rank")
    if rank is not None:
        rank = _int(rank, "rank", where)
        if rank >= world_size:
            raise ManifestError(f"{where}: rank {rank} is not below world_size {world_size}")
    save_id = d.get("save_id")
    if not isinstance(save_id, str) or not save_id or len(save_id) > MAX_KEY_LEN:
        raise ManifestError(f"{where}: save_id must be a non-empty string of at most {MAX_KEY_LEN} characters")
    tensors_raw = d["tensors"]
    if not isinstance(tensors_raw, dict):
        raise ManifestError(f"{where}: tensors must be an object")
    objects_raw = d["objects"]
    if not isinstance(objects_raw, list):
        raise ManifestError(f"{where}: objects must be a list")
    storage_raw = d["storage"]
    if not isinstance(storage_raw, dict) or len(storage_raw) > world_size:
        raise ManifestError(f"{where}: storage must be an object with at most one entry per rank")
    metadata = d.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: metadata must be an object")
    storage = {}
    for r, s in storage_raw.items():
        if not (r.isascii() and r.isdigit() and len(r) < 8 and int(r) < world_size) or s not in STORAGE_KINDS:
            raise ManifestError(f"{where}: bad storage entry {r!r}: {s!r}"[:300])
        storage[int(r)] = s
    if tensors_raw and max(map(len, tensors_raw)) > MAX_NAME_LEN:  # (JSON keys are strings)
        for n in tensors_raw:
            _str(n, "a tensor name", where)
    packed = _packed_keys(d.get("packed"), where, world_size, d["version"])
    if "dirs" in d and d["version"] < GRID_VERSION:
        raise ManifestError(f"{where}: a version {d['version']} manifest has no dirs member; the file was edited")
    dirs = check_dirs(d.get("dirs"), where, world_size)
    late = [k for k in ("codecs", "refs", "hashes", "deltas") if k in d]
    if late and d["version"] < INCREMENTAL_VERSION:
        raise ManifestError(f"{where}: a version {d['version']} manifest has no {late[0]} member; the file was edited")
    table = d.get("table")
    if table is not None:
        if d["version"] < TABLE_VERSION:
            raise ManifestError(f"{where}: a version {d['version']} manifest has no table member; the file was edited")
        if not keep_table:
            tensors_raw, table = with_table(tensors_raw, table, where, rank, dirs), None
    return Header(
        d["version"], save_id, world_size, rank, storage, packed, dirs, metadata, tensors_raw, objects_raw,
        check_codecs(d.get("codecs"), where, world_size), refs := check_refs(d.get("refs"), where),
        check_hashes(d.get("hashes"), where), check_deltas(d.get("deltas"), where, refs), table,
    )


def with_table(tensors: dict[str, Any], table: Any, where: str, rank: int | None, dirs: Mapping[int, str]) -> dict[str, Any]:
    """A manifest's `tensors` and its chunk table's tensors as one dict of entry JSON."""
    more = expand_table(table, where, rank, dirs.get(rank, f"data/{rank}") if rank is not None else "")
    both = [n for n in more if n in tensors]
    if both:
        raise ManifestError(f"{where}: tensor {both[0]!r} is listed both in tensors and in the table"[:300])
    return {**more, **tensors}  # (the table's tensors first: a writer's split tensors come first in its order)


@paused_gc()
def merge_manifests(parts: Sequence[Manifest], where: str) -> Manifest:
    """Merge rank manifests 0..W-1 into one (chunks concatenated in rank order), as objects.

    Readers merge rank manifests as they parse them (`xckpt.manifest._merge`, which
    also recognises grids); this is the same merge of manifests already built.

    Tensors must agree on dtype and shape across ranks; replicated objects must
    agree in value (they are then stored once).
    """
    first = parts[0]
    tensors: dict[str, TensorEntry] = {}
    chunks: dict[str, list[Chunk]] = {}
    objects: dict[tuple[str, int | None], ObjectEntry] = {}
    storage: dict[int, str] = {}
    metadata: dict[str, Any] = {}
    dirs: dict[int, str] = {}
    codecs: dict[int, str] = {}
    refs: dict[str, Ref] = {}
    hashes: dict[str, str] = {}
    deltas: dict[str, tuple[Patch, ...]] = {}
    for m in parts:
        storage.update(m.storage)
        dirs.update(m.dirs)
        codecs.update(m.codecs)
        refs.update(m.refs)
        hashes.update(m.hashes)
        deltas.update(m.deltas)
        metadata.update(m.metadata)
        for name, t in m.tensors.items():
            prev = tensors.get(name)
            if prev is None:
                tensors[name] = t
                chunks[name] = list(t.chunks)
                continue
            if prev.dtype != t.dtype or prev.shape != t.shape:
                raise ManifestError(
                    f"{where}: tensor {name!r} is {prev.dtype}{list(prev.shape)} on one rank and "
                    f"{t.dtype}{list(t.shape)} on rank {m.rank}; every rank must save the same "
                    "global tensor"
                )
            if prev.placement is None and t.placement is not None:
                tensors[name] = replace(prev, placement=t.placement)
            if prev.value_range is None and t.value_range is not None:
                tensors[name] = replace(tensors[name], value_range=t.value_range)
            chunks[name].extend(t.chunks)
        for o in m.objects:
            k = (o.name, o.rank if o.per_rank else None)
            prev_o = objects.get(k)
            if prev_o is None:
                objects[k] = o
            elif o.kind == "json" and prev_o.kind == "json" and o.value != prev_o.value:
                raise ManifestError(
                    f"{where}: replicated object {o.name!r} differs between rank {prev_o.rank} "
                    f"and rank {o.rank}; save it with per_rank=True if each rank has its own value"
                )
    merged = {n: replace(t, chunks=tuple(chunks[n])) for n, t in tensors.items()}
    return Manifest(
        save_id=first.save_id,
        world_size=first.world_size,
        rank=None,
        tensors=merged,
        objects=tuple(objects.values()),
        storage=storage,
        metadata=metadata,
        dirs=dirs,
        codecs=codecs,
        refs=refs,
        hashes=hashes,
        deltas=deltas,
    )
