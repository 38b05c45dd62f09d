"""The commit protocol's read side: which save is at a location, and is it complete.

A rank writes its data, makes it durable, then writes ``ranks/<rank>.json``; in
coordinated mode rank 0 then writes the merged ``xckpt.json`` (DESIGN.md section
2). Both the reader (opening a checkpoint without ``xckpt.json``) and the writer
(rank 0 merging after the barrier, or any rank finalizing a rank-local save)
read the rank manifests the same way, here.

Which save is read: the one rank 0's manifest belongs to (its save_id and world
size). Rank manifests at or above that world size are leftovers of an earlier
save with more ranks and are ignored; a rank whose ``ranks/<r>.json`` is still a
claim (:class:`~xckpt.manifest.Claim`) has not committed.
"""

from __future__ import annotations

import re
from typing import Any

from xckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, ManifestError
from xckpt.layout import check_coverage
from xckpt.manifest import Claim, Manifest, merge_manifests, parse_claim
from xckpt.storage import Storage

__all__ = ["read_rank_manifests", "validate"]

#: A rank manifest's key (rank numbers below 10^7; ASCII digits only).
_RANK_KEY = re.compile(r"^ranks/[0-9]{1,7}\.json$")

def _first(ranks: Any, n: int = 20) -> str:
    shown = sorted(ranks)[:n]
    return str(shown)[:-1] + (f", ... ({len(ranks)} ranks)]" if len(ranks) > n else "]")


def read_rank_manifests(
    storage: Storage,
    *,
    expect_world_size: int | None = None,
    expect_save_id: str | None = None,
) -> Manifest:
    """Read, check and merge ``ranks/0..W-1.json`` into one validated manifest.

    W and the save are rank 0's (or ``expect_*``); manifests of ranks >= W are
    leftovers of an earlier, larger save and are not read.
    """
    where = storage.path
    keys = [k for k in storage.list_prefix("ranks/") if k.endswith(".json")]
    ranks = sorted(int(k[6:-5]) for k in keys if _RANK_KEY.match(k))
    if not ranks:
        raise CheckpointNotFoundError(
            f"no xckpt checkpoint at {where!r}: neither xckpt.json nor ranks/<rank>.json exists"
        )
    if expect_world_size is not None:
        ranks = [r for r in ranks if r < expect_world_size]
    datas = storage.read_keys([f"ranks/{r}.json" for r in ranks])
    parts: dict[int, Manifest] = {}
    claims: dict[int, Claim] = {}
    for r, data in zip(ranks, datas):
        if data is None:
            continue
        claim = parse_claim(data, f"{where}/ranks/{r}.json")
        if claim is not None:
            claims[r] = claim
            continue
        parts[r] = Manifest.loads(data, f"{where}/ranks/{r}.json")
        if parts[r].rank != r:
            raise ManifestError(f"{where}/ranks/{r}.json says it is rank {parts[r].rank}")
    if not parts:
        raise CheckpointNotFoundError(
            f"no xckpt checkpoint at {where!r}: a save has claimed it (ranks {_first(claims)}, save "
            f"{next(iter(claims.values())).save_id!r}) and not committed; it is still running or it "
            "failed. Wait for it to finish, or save again with overwrite=True"
        )
    ref = parts[0] if 0 in parts else parts[min(parts)]
    world = expect_world_size or ref.world_size
    save_id = expect_save_id if expect_save_id is not None else ref.save_id
    # Bounded by what storage holds: nothing below loops over range(world).
    present = {r: m for r, m in parts.items() if r < world}
    pending = sorted(r for r in claims if r < world)
    stale = {r: m.save_id for r, m in present.items() if m.save_id != save_id}
    other_w = {r: m.world_size for r, m in present.items() if m.world_size != world}
    if len(present) < world or stale or other_w:
        bits = []
        n_missing = world - len(present) - len(pending)
        if n_missing:
            missing: list[int] = []
            r = 0
            while len(missing) < min(n_missing, 20):
                if r not in present and r not in claims:
                    missing.append(r)
                r += 1
            more = f", ... ({n_missing} ranks)" if n_missing > len(missing) else ""
            bits.append(f"rank manifests missing: {str(missing)[:-1]}{more}]")
        if pending:
            bits.append(
                f"ranks {_first(pending)} have claimed the location and not committed (a save is running "
                "or failed)"
            )
        if stale:
            bits.append(f"ranks {_first(stale)} belong to another save ({dict(list(stale.items())[:5])}, "
                        f"expected {save_id!r})")
        if other_w:
            bits.append(f"ranks {_first(other_w)} report world sizes {dict(list(other_w.items())[:5])}, "
                        f"expected {world}")
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
            if t.chunks[0].shape == t.shape and 0 not in t.shape:
                continue
        check_coverage(t.shape, [c.box for c in t.chunks], name=name, where=where)
