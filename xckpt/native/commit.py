"""The commit protocol: which save is at a location, is it complete, and its merged manifest.

A rank writes its data, makes it durable, then writes `ranks/<rank>.json`; in
coordinated mode rank 0 then writes the merged `xckpt.json` (DESIGN.md section
2). Both the reader (opening a checkpoint without `xckpt.json`) and the writer
(rank 0 merging after the barrier, or any rank finalizing a rank-local save)
read the rank manifests the same way, here.

Which save is read: the one rank 0's manifest belongs to (its save_id and world
size). Rank manifests at or above that world size are leftovers of an earlier
save with more ranks and are ignored; a rank whose `ranks/<r>.json` is still a
claim (`Claim`) has not committed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, ManifestError
from xckpt.layout import check_coverage
from xckpt.manifest import (
    Claim,
    GridChunks,
    Manifest,
    RankMerge,
    parse_claim,
    parse_document,
    parse_header,
    paused_gc,
)
from xckpt.storage import Location, Storage

__all__ = ["read_rank_manifests", "rows_tile", "validate"]

#: A rank manifest's key (rank numbers below 10^7; ASCII digits only).
_RANK_KEY = re.compile(r"^ranks/[0-9]{1,7}\.json$")

def _first(ranks: Any, n: int = 20) -> str:
    shown = sorted(ranks)[:n]
    return str(shown)[:-1] + (f", ... ({len(ranks)} ranks)]" if len(ranks) > n else "]")


#: Rank manifests read at once (concurrently); each batch's bytes are let go once merged.
_BATCH = 512


def _read_batched(storage: Storage, ranks: list[int], world: Callable[[], int | None]) -> Iterator[tuple[int, bytes | None]]:
    """`(rank, bytes or None)` for `ranks` in order, read `_BATCH` at a time; ranks
    at or above `world()` (once known) are not read."""
    for start in range(0, len(ranks), _BATCH):
        w = world()
        batch = [r for r in ranks[start : start + _BATCH] if w is None or r < w]
        datas = storage.read_keys([f"ranks/{r}.json" for r in batch])
        for i, r in enumerate(batch):
            data, datas[i] = datas[i], None
            w = world()
            if w is None or r < w:
                yield r, data


@paused_gc()  # (every manifest's JSON is many small objects, none in a cycle)
def read_rank_manifests(
    storage: Storage,
    *,
    expect_world_size: int | None = None,
    expect_save_id: str | None = None,
) -> Manifest:
    """Read, check and merge `ranks/0..W-1.json` into one validated manifest.

    W and the save are rank 0's (or `expect_*`); manifests of ranks >= W are
    leftovers of an earlier, larger save and are not read. Each manifest is merged as
    it is parsed (`RankMerge`: chunks as columns, grids
    recognised), so 4,096 rank manifests never exist as objects at once.
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
    claims: dict[int, Claim] = {}
    present: dict[int, tuple[str, int]] = {}  # rank -> (save_id, world_size) of its manifest
    merge: RankMerge | None = None
    world = save_id = None
    known: list[int] = []  # the world size, once the save read is known (ranks above it are not read)
    for r, data in _read_batched(storage, ranks, lambda: known[0] if known else None):
        if data is None:
            continue
        wh = f"{where}/ranks/{r}.json"
        claim = parse_claim(data, wh)
        if claim is not None:
            claims[r] = claim
            continue
        h = parse_header(parse_document(data, wh), wh, keep_table=True)
        del data
        if h.rank != r:
            raise ManifestError(f"{where}/ranks/{r}.json says it is rank {h.rank}")
        if merge is None:  # the save read: rank 0's (the lowest present), unless expected
            world = expect_world_size or h.world_size
            known.append(world)
            save_id = expect_save_id if expect_save_id is not None else h.save_id
            merge = RankMerge(where, world)
            if r >= world:
                continue
        present[r] = (h.save_id, h.world_size)
        if h.save_id == save_id and h.world_size == world:
            merge.add(h, wh)
    if merge is None or world is None:
        raise CheckpointNotFoundError(
            f"no xckpt checkpoint at {where!r}: a save has claimed it (ranks {_first(claims)}, save "
            f"{next(iter(claims.values())).save_id!r}) and not committed; it is still running or it "
            "failed. Wait for it to finish, or save again with overwrite=True"
        )
    # Bounded by what storage holds: nothing below loops over range(world).
    pending = sorted(r for r in claims if r < world)
    stale = {r: s for r, (s, _) in present.items() if s != save_id}
    other_w = {r: w for r, (_, w) in present.items() if w != world}
    if len(present) < world or stale or other_w:
        raise _incomplete(where, world, save_id, present, claims, pending, stale, other_w)
    merged = merge.result()
    validate(merged, where)
    return merged



def _incomplete(
    where: str,
    world: int,
    save_id: str | None,
    present: dict[int, tuple[str, int]],
    claims: dict[int, Claim],
    pending: list[int],
    stale: dict[int, str],
    other_w: dict[int, int],
) -> IncompleteCheckpointError:
    """The error for a save not every rank committed: which ranks are missing, still
    claiming, of another save, or of another world size."""
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
    return IncompleteCheckpointError(
        f"checkpoint {where!r} of {world} ranks is incomplete: " + "; ".join(bits) + ". The "
        "save did not finish on every rank (or was overwritten part way); re-run the save, "
        "or load an earlier checkpoint"
    )


def validate(m: Manifest, where: str) -> None:
    """Check every tensor's chunks tile its shape exactly (LayoutError otherwise). A grid's
    tiling is its split points' arithmetic, checked when it was read or recognised; a save
    split along the first dimension only is checked as a sorted run of row ranges
    (`rows_tile`), a fraction of the general check's cost; every other layout takes the
    general one."""
    for name, t in m.tensors.items():
        if isinstance(t.chunks, GridChunks):
            continue
        if len(t.chunks) == 1 and t.chunks[0].offset == (0,) * len(t.shape):
            if t.chunks[0].shape == t.shape and 0 not in t.shape:
                continue
        if rows_tile(t.shape, t.chunks):
            continue
        check_coverage(t.shape, [c.box for c in t.chunks], name=name, where=where)


def rows_tile(shape: tuple[int, ...], chunks: Sequence[Any]) -> bool:
    """True when `chunks` are row ranges (whole in every other dimension) that cover
    `0..shape[0]` in order with no gap or overlap; False: not of that form, or not a tiling
    (the general check then says why)."""
    if not shape or 0 in shape:
        return False
    rest = shape[1:]
    runs = []
    for c in chunks:
        if c.shape[1:] != rest or any(c.offset[1:]) or len(c.offset) != len(shape):
            return False
        runs.append((c.offset[0], c.shape[0]))
    runs.sort()
    end = 0
    for start, n in runs:
        if start != end or n <= 0:
            return False
        end = start + n
    return end == shape[0]


def finalize(path: Location, world_size: int, save_id: str, context: Any = None) -> Manifest:
    """Merge ranks 0..W-1 into `xckpt.json` (rank 0, after all ranks committed).

    Validates the merged layout first, and removes rank manifests of a larger
    earlier save at the same location.
    """
    storage = Storage(path, context)
    merged = read_rank_manifests(storage, expect_world_size=world_size, expect_save_id=save_id)
    for key in storage.list_prefix("ranks/"):
        stem = key[len("ranks/") : -len(".json")] if key.endswith(".json") else ""
        if stem.isascii() and stem.isdigit() and len(stem) < 8 and int(stem) >= world_size:
            storage.delete_key(key)
            storage.delete_range(f"data/{stem}.", f"data/{stem}0")  # data/<r>/ and data/<r>.<token>/
    storage.write_key("xckpt.json", merged.dumps())
    return merged
