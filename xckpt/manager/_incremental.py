"""Incremental saves in a manager root (DESIGN.md section 12): references and their retention.

A manager save passes its writers a `Dedup` of the previous complete step (the highest
below the step being saved): each array chunk whose BLAKE2b-128 hash equals that of the
same box of the same tensor there is recorded as a reference (`refs` in the manifest,
naming the step that holds the bytes), not written again; a 2-D box of which fewer than
half the rows changed since that step (compared with the staged copy, when the staging
holds that step's values) is stored as a row patch over its base (`deltas`).

Retention then deletes data only when no kept step references it, in two phases, so a
kill at any moment never leaves a complete step whose data is gone:

1. the manifests (`xckpt.json`, then `ranks/*.json`) of every step to drop, stale
   incomplete ones included: from here on only kept steps are complete (durable on a
   local disk before phase 2);
2. the data of each dropped step that no kept step references (read from the kept
   steps' manifests before anything is deleted); a referenced one stays as a data-only
   step (incomplete: never listed, never restored) until no kept step needs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from xckpt.errors import XckptError
from xckpt.manifest import Manifest
from xckpt.native._refs import Dedup
from xckpt.native.reader import Checkpoint
from xckpt.native.steps import StepInfo, delete_step, step_location
from xckpt.storage import Location, Storage, fsync_dir, location_name

__all__ = [
    "ManifestCache", "dedup_for", "base_step", "retain_steps", "delete_manifests", "check_replace", "rows_predicate",
]


class ManifestCache:
    """The merged manifests of complete steps, read once each (a step's manifest never
    changes while it is complete)."""

    def __init__(self, root: Location) -> None:
        self.root = root
        self._m: dict[int, Manifest] = {}

    def get(self, step: int) -> Manifest:
        m = self._m.get(step)
        if m is None:
            ck = Checkpoint(step_location(self.root, step))
            try:
                m = ck.manifest
            finally:
                ck.close()
            self._m[step] = m
        return m

    def forget(self, steps: Iterable[int]) -> None:
        for s in steps:
            self._m.pop(s, None)

    def uses(self, step: int) -> set[int]:
        """The steps whose data step `step` reads: its references' and its row patches'."""
        m = self.get(step)
        return {r.step for r in m.refs.values()} | {p.step for chain in m.deltas.values() for p in chain}

    def referenced(self, steps: Iterable[int]) -> set[int]:
        """The steps whose data `steps` read (themselves included when they do)."""
        out: set[int] = set()
        for s in steps:
            out |= self.uses(s)
        return out


def dedup_for(
    cache: ManifestCache, base: int | None, step: int, changed: Any = None, full_every: int = 8
) -> Dedup:
    """What a save of `step` compares with: step `base` (None: only hashes are recorded),
    and with `changed` (the staging's changed rows, when it holds `base`'s values) row deltas."""
    if base is None:
        return Dedup(step=step)
    return Dedup(base, cache.get(base), step=step, changed=changed, full_every=full_every)


def base_step(infos: Mapping[int, StepInfo], step: int) -> int | None:
    """The step a save of `step` references: the highest complete step below it."""
    below = [s for s, i in infos.items() if i.complete and s < step]
    return max(below) if below else None


def rows_predicate(row_deltas: Any) -> Any:
    """Which tensors (by name) a manager compares row by row: `True` every one, a list of
    names those, `False` none (None).

    Raises:
        XckptError: anything else.
    """
    if row_deltas is True:
        return lambda name: True
    if row_deltas is False:
        return None
    if isinstance(row_deltas, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in row_deltas):
        names = frozenset(row_deltas)
        return names.__contains__
    raise XckptError(f"row_deltas={row_deltas!r}: pass True (every 2-D tensor), False, or a list of tensor names")


def delete_manifests(root: Location, step: int) -> None:
    """Make step `step` incomplete, keeping its data: `xckpt.json`, then every
    `ranks/<r>.json` (durable on a local disk before this returns)."""
    storage = Storage(step_location(root, step))
    storage.delete_key("xckpt.json")
    if storage.root is not None:
        fsync_dir(storage.root, missing_ok=True)
    storage.delete_prefix("ranks/")
    if storage.root is not None:
        fsync_dir(os.path.join(storage.root, "ranks"), missing_ok=True)


def retain_steps(
    root: Location, cache: ManifestCache, kept: Iterable[int], drop: Iterable[int], done: Any = None
) -> set[int]:
    """Drop the steps `drop` (complete ones the policy lets go and stale incomplete ones)
    keeping every byte the complete steps `kept` reference (see the module); returns the
    dropped steps kept as data. `done(step)` is called as each step is handled."""
    drop = sorted(set(drop))
    needed = cache.referenced(kept)  # before anything is deleted
    for s in drop:
        delete_manifests(root, s)
    cache.forget(drop)
    for s in drop:
        if s not in needed:
            delete_step(root, s)
        if done is not None:
            done(s)
    return needed & set(drop)


def check_replace(root: Location, cache: ManifestCache, complete: Iterable[int], step: int) -> None:
    """Refuse to save over step `step` while a complete step references its data.

    Raises:
        XckptError: naming the steps that reference it.
    """
    users = [s for s in complete if s != step and step in cache.uses(s)]
    if users:
        raise XckptError(
            f"step {step} of {location_name(root)!r} is kept as data: complete steps {users} reference its "
            "unchanged chunks, so it cannot be saved again. Save another step number"
        )
