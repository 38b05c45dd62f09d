"""The manifest members of format version 6: codecs, references to other steps' arrays, hashes.

All three are optional top-level members, keyed the way the data is (so rank manifests
merge by union, and grids, packed rows and chunk lists stay as version 5 has them):

- `"codecs": {"<rank>": "zstd" | "shuffle-zstd"}`: the array chunks in that rank's data
  directory are compressed so (`xckpt.native._codecs`); absent: raw;
- `"refs": {"<array key>": {"step": M, "key": K, "storage": S, "codec": C?}}`: in a
  manager root, the array the manifest names `<array key>` is not stored in this step:
  it is array `K` of step `M`, the sibling checkpoint `<root>/<M>/`, in storage kind
  `S` (and codec `C`). A reference always names the step that holds the bytes (never
  another reference), and `K` passes the same key checks as every key;
- `"hashes": {"<array key>": "<32 hex digits>"}`: BLAKE2b-128 of the array chunk's raw
  bytes (little-endian, C order), written by manager saves that reference unchanged
  chunks, so the next save can compare without reading the data back;
- `"deltas": {"<array key>": [patch, ...]}`: row deltas of a 2-D array chunk (whose
  `refs` entry names its base, a full copy). Its value is the base with each patch
  applied in order; a patch `{"step": S, "key": P, "rows": n, "grid": g, "storage",
  "codec"?}` is two arrays of step `S`: `P-idx` (n int64 row indices inside the
  chunk, increasing) and `P-rows` (n rows of the chunk's dtype and width), both in
  zarr chunks of `g` rows; each patch's rows replace those rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from xckpt.errors import ManifestError
from xckpt.manifest._checks import MAX_CHUNKS, MAX_WORLD_SIZE, STORAGE_KINDS, _check_key

__all__ = [
    "CODEC_NAMES", "Ref", "Patch", "check_codecs", "check_refs", "check_hashes", "check_deltas", "incremental_json",
]

#: Codecs a manifest may name (version 6).
CODEC_NAMES = ("zstd", "shuffle-zstd")
#: Largest step number a reference may name (the manager's 19 digits).
_MAX_STEP = 10**19 - 1
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Ref:
    """Where a referenced array is stored: array `key` of step `step` of the same root."""

    step: int
    key: str
    storage: str
    codec: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "key": self.key, "storage": self.storage}
        if self.codec is not None:
            d["codec"] = self.codec
        return d


#: Longest chain of patches one chunk may name (the manager's full_every bounds it far lower).
MAX_PATCHES = 1024


@dataclass(frozen=True)
class Patch:
    """Row delta of an array chunk: `rows` rows stored as arrays `key-idx` and `key-rows`
    of step `step`, in zarr chunks of `grid` rows."""

    step: int
    key: str
    rows: int
    grid: int
    storage: str
    codec: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "key": self.key, "rows": self.rows, "grid": self.grid,
                             "storage": self.storage}
        if self.codec is not None:
            d["codec"] = self.codec
        return d


def _object(raw: Any, what: str, where: str, most: int) -> dict[str, Any]:
    if not isinstance(raw, dict) or len(raw) > most:
        raise ManifestError(f"{where}: {what} must be an object of at most {most} entries")
    return raw


def _by_chunk_key(raw: Any, what: str, where: str) -> Iterator[tuple[str, Any]]:
    """The members of `what`, an object by chunk key (absent: none): at most `MAX_CHUNKS`,
    each key as strict as chunk keys (checked as it comes)."""
    if raw is None:
        return
    for k, v in _object(raw, what, where, MAX_CHUNKS).items():
        _check_key(k, where)
        yield k, v


def check_codecs(raw: Any, where: str, world_size: int) -> dict[int, str]:
    """The `codecs` member, checked (absent: `{}`)."""
    if raw is None:
        return {}
    out = {}
    for r, c in _object(raw, "codecs", where, min(world_size, MAX_WORLD_SIZE)).items():
        if not (r.isascii() and r.isdigit() and len(r) < 8 and int(r) < world_size) or c not in CODEC_NAMES:
            raise ManifestError(f"{where}: bad codecs entry {r!r}: {c!r}; codecs are {CODEC_NAMES}"[:300])
        out[int(r)] = c
    return out


def check_refs(raw: Any, where: str) -> dict[str, Ref]:
    """The `refs` member, checked (absent: `{}`): every key as strict as chunk keys."""
    out = {}
    for k, v in _by_chunk_key(raw, "refs", where):
        if not isinstance(v, dict) or set(v) - {"step", "key", "storage", "codec"}:
            raise ManifestError(f"{where}: reference of {k[:80]!r} must be {{step, key, storage, codec?}}")
        step, key, storage, codec = v.get("step"), v.get("key"), v.get("storage"), v.get("codec")
        if type(step) is not int or not 0 <= step <= _MAX_STEP:
            raise ManifestError(f"{where}: reference of {k[:80]!r} names step {step!r}, not a step number"[:300])
        if storage not in STORAGE_KINDS or (codec is not None and codec not in CODEC_NAMES):
            raise ManifestError(f"{where}: reference of {k[:80]!r}: bad storage {storage!r} or codec {codec!r}"[:300])
        out[k] = Ref(step, _check_key(key, where), storage, codec)
    return out


def check_hashes(raw: Any, where: str) -> dict[str, str]:
    """The `hashes` member, checked (absent: `{}`)."""
    out = {}
    for k, h in _by_chunk_key(raw, "hashes", where):
        if not (isinstance(h, str) and len(h) == 32 and set(h) <= _HEX):
            raise ManifestError(f"{where}: hash of {k[:80]!r} must be 32 lowercase hex digits"[:300])
        out[k] = h
    return out


def check_deltas(raw: Any, where: str, refs: Mapping[str, Ref]) -> dict[str, tuple[Patch, ...]]:
    """The `deltas` member, checked (absent: `{}`): each chunk with deltas has a base in `refs`."""
    out = {}
    for k, chain in _by_chunk_key(raw, "deltas", where):
        if k not in refs or not isinstance(chain, list) or not 0 < len(chain) <= MAX_PATCHES:
            raise ManifestError(f"{where}: deltas of {k[:80]!r} must be a list of patches over a base in refs")
        patches = []
        for p in chain:
            if not isinstance(p, dict) or set(p) - {"step", "key", "rows", "grid", "storage", "codec"}:
                raise ManifestError(f"{where}: a patch of {k[:80]!r} must be {{step, key, rows, grid, storage, codec?}}")
            step, key, rows, grid = p.get("step"), p.get("key"), p.get("rows"), p.get("grid")
            storage, codec = p.get("storage"), p.get("codec")
            if (type(step) is not int or not 0 <= step <= _MAX_STEP or type(rows) is not int or not 0 < rows < 1 << 40
                    or type(grid) is not int or not 0 < grid < 1 << 40 or storage not in STORAGE_KINDS
                    or (codec is not None and codec not in CODEC_NAMES)):
                raise ManifestError(f"{where}: bad patch of {k[:80]!r}: {p!r}"[:300])
            patches.append(Patch(step, _check_key(key, where), rows, grid, storage, codec))
        out[k] = tuple(patches)
    return out


def incremental_json(
    codecs: Mapping[int, str], refs: Mapping[str, Ref], hashes: Mapping[str, str],
    deltas: Mapping[str, tuple[Patch, ...]] | None = None,
) -> dict[str, Any]:
    """The version 6 members of a manifest document (only those that are not empty)."""
    doc: dict[str, Any] = {}
    if codecs:
        doc["codecs"] = {str(r): c for r, c in sorted(codecs.items())}
    if refs:
        doc["refs"] = {k: r.to_json() for k, r in sorted(refs.items())}
    if hashes:
        doc["hashes"] = dict(sorted(hashes.items()))
    if deltas:
        doc["deltas"] = {k: [p.to_json() for p in chain] for k, chain in sorted(deltas.items())}
    return doc
