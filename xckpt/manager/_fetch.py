"""Restore from the newest complete step of either tier, verified (DESIGN.md section 11).

Call protocol (`restore`, every rank of the manager's group, after the saves in
flight finished):

1. each rank lists what its local directory holds (every rank manifest's checksum
   checked and only its header parsed, `signed_header`: the bytes are kept for step 2; a
   damaged one is a warning on that rank) and the ranks exchange it, with rank 0's list of
   the persistent root's step numbers (one listing, made while rank 0 lists its directory:
   no manifest or data of the root is read unless a persistent step is the one restored);
2. every rank walks the same candidates, newest first (a step in both tiers: the
   local copy first). A local step is a candidate when the surviving copies hold
   parts `0..W-1` of one save. Its manifest: where every rank with copies has its
   node's merged manifest of the save (`xckpt.manager._merged`), the first of them reads
   it and broadcasts its bytes, and every rank checks those bytes (checksum, save, world
   size, layout: one exchange; alike bytes, alike outcome, so none is exchanged). Else,
   or when it is gone or fails its check (a warning on its reader), a rank manifest that
   some rank holds no copy of is sent by one holder to every rank (one exchange) and
   each rank merges the step's manifest from its own copies and those it received;
3. the ranks load it with `xckpt.torch.load(..., read_once=True)` over a source
   whose chunks are read only by ranks holding a copy of them (`holders`): a rank
   that needs bytes it does not hold receives them from a holder. Every chunk a
   holder reads is checked against its crc32 (zarr's crc32c codec, packed chunks'
   crc32s); a copy that fails is named in a warning on the rank that read it, and
   after an exchange of outcomes (a flag each; which copies failed only when one did)
   every rank retries without that copy (another
   replica serves), or, with no intact copy left, passes to the next candidate;
4. a persistent candidate is restored from the root as the manager always did (rank
   0 checks it is complete first).

A step passed over is named in a warning (on the rank that found why) with the rank
and the problem; a restore never fills a target from a copy that failed a check.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple
from typing import Any

from xckpt.errors import ManifestError, XckptError
from xckpt.manifest import Manifest, RankMerge, parse_document, parse_header, paused_gc
from xckpt.native.commit import validate
from xckpt.native.reader import Checkpoint
from xckpt.native.steps import read_step, step_location, step_numbers
from xckpt.source import ChunkRead
from xckpt.storage import Location

from ._merged import MERGED, load_merged, read_merged
from ._tiers import Held, Tiers, coverage, holders_of

__all__ = ["TierSource", "restore"]


class TierSource(Checkpoint):
    """A local step read from this rank's copies: the merged manifest of every copy, chunk
    reads from this node's directory, and which ranks hold each chunk (`holders`, what
    the read-once plan reads)."""

    def __init__(self, path: str, manifest: Manifest, holders: Mapping[int, frozenset[int]]) -> None:
        super().__init__(path, manifest=manifest)
        self._holders = holders
        #: (saved rank, problem) of every copy this rank failed to read.
        self.bad: list[tuple[int, str]] = []

    def holders(self, name: str, index: int) -> frozenset[int]:
        return self._holders.get(self.info(name).chunks[index].rank, frozenset())

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        try:
            super()._read_chunks(jobs, bar)
        except XckptError as first:
            # which copies fail: each job reads one saved chunk, of one writer rank
            for job in jobs:
                try:
                    super()._read_chunks([job], _NoBar())
                except XckptError as e:
                    self.bad.append((job[1].rank, f"{type(e).__name__}: {e}"))
            if not self.bad:
                self.bad.append((-1, f"{type(first).__name__}: {first}"))
            raise


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _merge(docs: Mapping[int, bytes], world: int, save_id: str, where: str, parsed: Mapping[int, Any]) -> Manifest:
    """The step's manifest from its rank manifests: `parsed` (this rank's own copies, each
    checked on its own first, so a damaged one is told apart) or else `docs` (bytes from
    their holders, checked here)."""
    merge = RankMerge(where, world)
    for r in range(world):
        wh = f"{where}/ranks/{r}.json"
        h = parsed[r] if r in parsed else parse_header(parse_document(docs[r], wh), wh, keep_table=True)
        if h.rank != r or h.save_id != save_id or h.world_size != world:
            raise ManifestError(f"{wh} is rank {h.rank} of save {h.save_id!r}, expected rank {r} of {save_id!r}")
        merge.add(h, wh)
    m = merge.result()
    validate(m, where)
    return m


def _alike(tiers: Tiers, rank: int) -> frozenset[int]:
    """The ranks reading the same copies as `rank` (its node's directory)."""
    return frozenset(r for r, p in enumerate(tiers.places) if p == tiers.places[rank])


def _warn(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _merged(tiers: Tiers, step: int, save_id: str, world: int, merged_at: frozenset[int]) -> Manifest | None:
    """The step's merged manifest (collective): the first rank in `merged_at` reads its
    node's copy and sends its bytes to every rank (one broadcast), and every rank checks
    those same bytes, so every rank reaches the same outcome without exchanging it. None on
    every rank when that copy is absent or fails its check (warned on the rank that read it)."""
    coord, me = tiers.coord, tiers.rank
    sdir = tiers.step_dir(step)
    sender = min(merged_at)
    data = coord.share(read_merged(sdir) if me == sender else None, src=sender)
    problem = f"{sdir}/{MERGED} is gone" if data is None else None
    m = None
    if data is not None:
        try:
            m = load_merged(data, sdir, save_id, world)
        except XckptError as e:
            problem = f"{type(e).__name__}: {e}"
    if m is None and me == sender:
        _warn(f"local step {step}: rank {me}'s merged manifest is not used ({(problem or '')[:400]}); "
              "the rank manifests are merged instead")
    return m


def _from_ranks(
    tiers: Tiers,
    step: int,
    save_id: str,
    world: int,
    holders: dict[int, frozenset[int]],
    kept: Mapping[tuple[int, int, str], bytes],
) -> Manifest | None:
    """The step's manifest merged from its rank manifests (collective): a part's manifest
    travels only to ranks without a copy of their own. None when some copy is damaged
    (warned; `holders` loses it)."""
    coord, me = tiers.coord, tiers.rank
    sdir = tiers.step_dir(step)
    chosen = {w: min(holders[w]) for w in range(world)}
    wanted = {w for w in range(world) if len(holders[w]) < coord.world}  # some rank holds no copy
    parsed: dict[int, Any] = {}
    problem = None  # (part, what is wrong): the first own copy that fails its whole check
    for w in (w for w in range(world) if me in holders[w]):
        wh = f"{sdir}/ranks/{w}.json"
        try:
            d = parse_document(kept[(step, w, save_id)], wh)
            Manifest.from_json(d, wh)  # every entry: the listing checked the header only
            parsed[w] = parse_header(d, wh, keep_table=True)  # (the same document, not parsed again)
        except XckptError as e:  # its checksum holds (a faulty writer's), its content does not
            problem = (w, f"{type(e).__name__}: {e}")
            break
    mine: dict[int, bytes] = {}
    if problem is None:
        for w in (w for w, h in chosen.items() if h == me and w in wanted):
            mine[w] = kept[(step, w, save_id)]
    got = coord.gather((mine, problem))
    bad = {(w, r): p for r, (_m, pr) in enumerate(got) if pr is not None for w, p in [pr]}
    docs = {w: d for m, _p in got for w, d in m.items()}
    if not bad:
        merged, failed = None, None
        try:
            merged = _merge(docs, world, save_id, sdir, parsed)
        except XckptError as e:
            failed = f"{e}"
        # each rank merged its own copies: one flag each, so that all go on or none
        if not coord.any(failed is not None):
            return merged
        # cannot tell which copy: every part's chosen copy is dropped, alike on every rank
        bad = {(w, chosen[w]): failed or "the parts do not merge on another rank" for w in range(world)}
    for (w, r), p in bad.items():
        if r == me:
            _warn(f"local step {step}: rank {me}'s copy of rank {w}'s part is damaged ({p})")
        holders[w] = holders[w] - _alike(tiers, r)
    return None


def _try_local(
    tiers: Tiers,
    step: int,
    save_id: str,
    world: int,
    everyone: Mapping[int, list[Held]],
    load: Callable[[Any], Any],
    kept: Mapping[tuple[int, int, str], bytes],
    merged_at: frozenset[int],
) -> tuple[bool, Any]:
    """Load local step `step` (collective); `(True, result)`, or `(False, None)` when no
    intact copy of some part is left (warned). `kept`: this rank's manifests as listed
    (`Tiers.scan`); `merged_at`: the ranks whose node holds the step's merged manifest
    (`xckpt.manager._merged`), read instead of merging the rank manifests."""
    coord, me = tiers.coord, tiers.rank
    holders = {w: frozenset(rs) for w, rs in holders_of(everyone, step, save_id).items()}
    sdir = tiers.step_dir(step)
    while True:
        lost = [w for w in range(world) if not holders.get(w)]
        if lost:
            if me == 0:
                _warn(
                    f"local step {step} is passed over: no intact copy of rank(s) {lost[:20]}'s part is left "
                    "(their node is gone or replaced and its replicas are missing or damaged)"
                )
            return False, None
        merged = _merged(tiers, step, save_id, world, merged_at) if merged_at else None
        if merged is None:
            merged_at = frozenset()  # absent or damaged somewhere: the rank manifests are merged
            merged = _from_ranks(tiers, step, save_id, world, holders, kept)
        if merged is None:
            continue  # a damaged rank manifest: `holders` lost its copies
        src = TierSource(sdir, merged, holders)
        err: BaseException | None = None
        result = None
        try:
            result = load(src)
        except Exception as e:  # every rank exchanges its outcome below
            err = e
        if not coord.any(err is not None or bool(src.bad)):  # one flag each; what failed travels only when something did
            return True, result
        outcomes = coord.gather((err is not None, src.bad))
        failed = [(r, b) for r, (f, bs) in enumerate(outcomes) if f for b in bs]
        if not failed or any(w < 0 for _r, (w, _p) in failed):
            if err is not None:
                raise err
            raise XckptError(f"restoring local step {step} failed on ranks {[r for r, (f, _) in enumerate(outcomes) if f]}")
        told = set()
        for r, (w, p) in failed:
            if r == me and w not in told:
                told.add(w)
                _warn(f"local step {step}: rank {me}'s copy of rank {w}'s part fails its check ({p[:400]}); "
                      "another copy is used if one is intact")
            holders[w] = holders[w] - _alike(tiers, r)


@paused_gc()  # merging builds many small objects, none in a cycle (see paused_gc)
def restore(
    tiers: Tiers,
    root: Location,
    name: str,
    step: int | None,
    known_complete: Callable[[], list[int]],
    load_local: Callable[[Any], Any],
    load_persistent: Callable[[Location], Any],
) -> Any:
    """The newest complete step of both tiers (or `step`), restored; see the module.

    Args:
        known_complete: rank 0's complete persistent steps from the manager's own record
            (no read of the root), to spare the check of a step it already knows.
        load_local: loads from a source (collective).
        load_persistent: loads from a persistent step's location (collective).
    """
    coord, me = tiers.coord, tiers.rank
    listing = None
    if me == 0:  # the root's listing (a round trip to an object store) while the local tier is scanned
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="xckpt-list")
        listing = pool.submit(step_numbers, root)
        pool.shutdown(wait=False)
    kept: dict[tuple[int, int, str], bytes] = {}
    held, problems = tiers.scan(kept)
    for p in problems:
        _warn(f"a local copy is damaged and not used: {p}")
    persistent = listing.result() if listing is not None else None
    have = sorted({(h.step, h.save_id) for h in held if os.path.exists(os.path.join(tiers.step_dir(h.step), MERGED))})
    got = coord.gather(([astuple(h) for h in held], persistent, have))
    everyone = {r: [Held(*t) for t in rows] for r, (rows, _p, _h) in enumerate(got)}
    numbers = set(got[0][1] or [])
    local = coverage([h for hs in everyone.values() for h in hs])
    candidates = sorted(set(local) | numbers, reverse=True)
    if step is not None:
        candidates = [step] if step in candidates else []
    for s in candidates:
        if s in local:
            full, sid, world = local[s]
            if full:
                at = frozenset(r for r, (_rows, _p, hv) in enumerate(got) if (s, sid) in {tuple(x) for x in hv})
                ok, result = _try_local(tiers, s, sid, world, everyone, load_local, kept, at)
                if ok:
                    return result
            elif me == 0:
                _warn(f"local step {s} is passed over: no surviving copy holds every rank's part of it")
        if s in numbers:
            verdict = None
            if me == 0:
                if s not in known_complete():
                    try:
                        info = read_step(root, s)
                    except XckptError as e:
                        verdict = f"cannot be read ({e})"
                    else:
                        verdict = None if info.complete else f"is incomplete ({(info.problem or '')[:300]})"
            verdict = coord.share(verdict)
            if verdict is None:
                return load_persistent(step_location(root, s))
            if me == 0:
                _warn(f"persistent step {s} of {name!r} is passed over: it {verdict}")
    local_done = sorted(s for s, (full, _i, _w) in local.items() if full)
    what = f"step {step}" if step is not None else "any step"
    raise XckptError(
        f"no complete copy of {what} under {name!r} or in the local tiers (local steps complete across the "
        f"surviving nodes: {local_done}; persistent step numbers: {sorted(numbers)}); nothing to restore. "
        "Start from scratch, or point the manager at the root and local directories that hold the run"
    )
