"""A local step's merged manifest: one document a restore parses instead of every rank's.

A rank-local save writes no merged `xckpt.json`, so a restore from the local tier
would merge the step's W rank manifests on every rank (the fixed cost a restore from
the persistent root, one merged manifest, does not pay). Once a local round's
replication finished (every copy of the step is stored), the first rank of each node
whose directory holds all W rank manifests of the save merges them, validates the
layout and writes `<step>/xckpt.json` (a temporary name, then a rename: a kill part
way leaves no merged manifest, and the rank manifests are untouched). A restore reads
it as any manifest: its own checksum, then `save_id`, world size and the layout
checked; when it is absent or fails, the rank manifests are merged as before.
"""

from __future__ import annotations

import os

from xckpt.errors import IncompleteCheckpointError, ManifestError, XckptError
from xckpt.manifest import Manifest
from xckpt.native.commit import read_rank_manifests, validate
from xckpt.storage import Storage

__all__ = ["MERGED", "drop_merged", "load_merged", "read_merged", "write_merged"]

#: The merged manifest's name in a local step's directory (as in a persistent step).
MERGED = "xckpt.json"


def write_merged(step_dir: str, save_id: str, world: int) -> bool:
    """Merge `step_dir`'s rank manifests `0..world-1` of save `save_id` into `step_dir/xckpt.json`.

    Returns False (nothing written) when the directory does not hold every rank's
    manifest of that save (some missing, or another save's); raises `XckptError` (or `OSError`) when they cannot be merged
    or the file cannot be written."""
    ranks = os.path.join(step_dir, "ranks")
    if not all(os.path.exists(os.path.join(ranks, f"{r}.json")) for r in range(world)):
        return False
    try:
        merged = read_rank_manifests(Storage(step_dir), expect_world_size=world, expect_save_id=save_id)
    except IncompleteCheckpointError:
        return False  # some rank manifest here is another save's (a leftover of an earlier one)
    final = os.path.join(step_dir, MERGED)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(merged.dumps())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True


def drop_merged(step_dir: str) -> None:
    """Delete a step's merged manifest (before the step is saved again or deleted); none is no error."""
    try:
        os.unlink(os.path.join(step_dir, MERGED))
    except (FileNotFoundError, NotADirectoryError):
        pass


def read_merged(step_dir: str) -> bytes | None:
    """The bytes of `step_dir`'s merged manifest, or None when there is none."""
    try:
        with open(os.path.join(step_dir, MERGED), "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def load_merged(data: bytes, step_dir: str, save_id: str, world: int) -> Manifest:
    """Parse and check a merged manifest of save `save_id` (its checksum, save, world size
    and layout). Raises `ManifestError` (or another `XckptError`) naming the file."""
    where = os.path.join(step_dir, MERGED)
    m = Manifest.loads(data, where)
    if m.rank is not None or m.save_id != save_id or m.world_size != world:
        raise ManifestError(
            f"{where} is rank {m.rank} of save {m.save_id!r} at world size {m.world_size}, expected the merged "
            f"manifest of {save_id!r} at world size {world}"
        )
    try:
        validate(m, step_dir)
    except XckptError as e:
        raise ManifestError(f"{where}: {e}") from e
    return m
