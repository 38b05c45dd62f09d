"""Checksummed JSON documents: a manifest's bytes with its SHA-256 as the last member,
the check of those bytes, and the claim a rank writes before its data (see
`Claim`). Re-exported by `xckpt.manifest`."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from xckpt.errors import ManifestError
from xckpt.manifest._checks import FORMAT, MAX_KEY_LEN, MAX_WORLD_SIZE, VERSION, _int, _str


def dumps_json(d: Any) -> bytes:
    """Compact JSON bytes (orjson: manifests of 100k chunks encode in milliseconds)."""
    return orjson.dumps(d)


_CHECKSUM_MEMBER = b',"checksum":"sha256:'
_CHECKSUM_TAIL = re.compile(rb',"checksum":"sha256:([0-9a-f]{64})"\}\s*\Z')


def manifest_bytes(doc: Mapping[str, Any]) -> bytes:
    """The bytes of a manifest document with its checksum as the last member."""
    body = dumps_json({k: v for k, v in doc.items() if k != "checksum"})
    digest = hashlib.sha256(body).hexdigest().encode()
    return b"".join((memoryview(body)[:-1], _CHECKSUM_MEMBER, digest, b'"}'))  # one copy of the body


def signed(data: bytes) -> bool:
    """Whether `data` carries a manifest checksum that matches: the bytes are a manifest
    exactly as a writer made them. A check of bytes alone, building no Python objects
    (a replica's manifest is checked on arrival in a background thread, where a JSON parse's
    objects brought on the process's full garbage collections: 0.15-0.24 s each in
    bench/tiers.py)."""
    return _checksum_state(data) is True


def _checksum_state(data: bytes) -> bool | None:
    """True: the bytes carry a checksum that matches; False: one that does not; None: none."""
    m = _CHECKSUM_TAIL.search(data, max(0, len(data) - 200))
    if m is None:
        return None
    h = hashlib.sha256(memoryview(data)[: m.start()])  # (no copy of a manifest of megabytes)
    h.update(b"}")
    return h.hexdigest().encode() == m.group(1)


#: How a rank's claim of a location begins (see `Claim`).
CLAIM_PREFIX = b'{"claim":true,'


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A rank's claim of a location: what `ranks/<rank>.json` holds while a save runs.

    A writer writes it with a conditional write before any data (so of two saves
    racing for a new location exactly one gets it) and replaces it with its
    manifest by another conditional write at commit. A reader counts a claimed
    rank as not committed.
    """

    save_id: str
    rank: int
    world_size: int
    token: str  # names the save's data directory, data/<rank>.<token>/ ("" for data/<rank>/)


def claim_bytes(c: Claim) -> bytes:
    """The bytes of a claim (JSON with a checksum, `"claim": true` first)."""
    return manifest_bytes(
        {"claim": True, "format": FORMAT, "version": VERSION, "save_id": c.save_id, "rank": c.rank,
         "world_size": c.world_size, "token": c.token}
    )


def parse_claim(data: bytes, where: str) -> Claim | None:
    """The claim in `data`, or None when `data` is not a claim (a manifest)."""
    if not data.startswith(CLAIM_PREFIX):
        return None
    if _checksum_state(data) is not True:
        raise ManifestError(f"{where}: a claim that fails its checksum; the file is corrupt")
    try:
        d = orjson.loads(data)
        return Claim(
            save_id=_str(d["save_id"], "save_id", where, MAX_KEY_LEN),
            rank=_int(d["rank"], "rank", where, hi=MAX_WORLD_SIZE),
            world_size=_int(d["world_size"], "world_size", where, lo=1, hi=MAX_WORLD_SIZE + 1),
            token=_str(d["token"], "token", where, 64),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise ManifestError(f"{where}: a malformed claim ({type(e).__name__}: {e})"[:300]) from None
