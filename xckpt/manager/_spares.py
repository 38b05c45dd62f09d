"""Spare files of the local tier: a dropped step's files, reused for the next step.

A local step written into fresh files of a tmpfs costs the kernel a page allocation per
4 KiB (on the 2-core test machine, 32 MiB written into /dev/shm took 0.024 CPU s, a
quarter of moving the bytes between two ranks), and a receive straight into a mapping of
a fresh file costs more (the kernel zeroes each page on its first touch). A page that
already belongs to a file costs neither. So when retention drops a local step, each rank
keeps the data files it owns in that step (its own part's, and those of the replicas it
received), moved under `<local>/.spare/<rank>/<part>/`, and the next step reuses them:

- the rank's own write (`xckpt.native._fileio.recycle_under`, `place`): a spare with the
  same name in the rank's key space is renamed into the new step and written over;
- the replicas it receives (`xckpt.manager._replicate`, `claim`): a spare with the same
  name in the source's key space is renamed into the new step, cut to its new size and
  mapped, and the process group's receive writes into its pages.

A file comes back every `local_keep + 1` rounds (written, kept, dropped, written again),
so the mappings replication makes of it (to send it, or to receive into it) are kept that
long too (`Mappings`): a round maps no page the round before last mapped already. A node
thus holds, between two saves, `local_keep` steps and one step as spares: what it held at
the peak of a save without them.

Each part of a step in a node's directory has one owner on the node: the rank whose part
it is, or the rank that received it as a replica. A rank releases only what it owns (the
part's rank manifest first, so the part no longer counts; then its data, moved to the
spares), so the ranks of a node never delete what another is moving. What no rank owns
(leftovers of an earlier run of another shape) is deleted a round later, once every rank
of the node is done with the step.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SPARE_DIR", "Mappings", "release", "tidy", "tidy_dir", "claim", "place", "clear"]

#: The spares' directory in a node's local directory (`<local>/.spare/<rank>/<source>/`);
#: its name is not a step's, so nothing lists it as one.
SPARE_DIR = ".spare"


def clear(path: str) -> None:
    """Delete `path` (spares no replica will use); none is no error."""
    shutil.rmtree(path, onerror=_missing_ok)


def _missing_ok(fn: Any, p: str, exc: Any) -> None:
    err = exc[1] if isinstance(exc, tuple) else exc
    if not isinstance(err, FileNotFoundError):
        raise err


def _key_spaces(step_dir: str, part: int) -> list[str]:
    """Part `part`'s data key spaces in `step_dir` (`data/<part>`, or `data/<part>.<token>`
    after an overwrite), as paths."""
    try:
        names = os.listdir(os.path.join(step_dir, "data"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [os.path.join(step_dir, "data", n) for n in sorted(names) if n == str(part) or n.startswith(f"{part}.")]


def release(step_dir: str, rank: int, sources: Sequence[int], spares: str | None) -> None:
    """Drop what rank `rank` owns of the local step at `step_dir`: its own part and the
    replicas of `sources`, each rank manifest before its data. Each part's data goes to
    `<spares>/<part>` (what was there before is deleted), or is deleted with `spares` None."""
    for part in (rank, *sources):
        try:
            os.unlink(os.path.join(step_dir, "ranks", f"{part}.json"))
        except (FileNotFoundError, NotADirectoryError):
            pass
    for part in (rank, *sources):
        spaces = _key_spaces(step_dir, part)
        if spares is not None and spaces:
            dest = os.path.join(spares, str(part))
            clear(dest)
            os.makedirs(spares, exist_ok=True)
            try:
                os.rename(spaces.pop(0), dest)
            except FileNotFoundError:
                pass  # deleted meanwhile (a close of another rank): no spares this time
        for path in spaces:
            clear(path)


def tidy(step_dir: str) -> None:
    """Remove the directories of `step_dir` that are empty, deepest first; one another rank
    still fills, or removed meanwhile, stays as it is."""
    data = os.path.join(step_dir, "data")
    try:
        subs = [os.path.join(data, n) for n in os.listdir(data)]
    except (FileNotFoundError, NotADirectoryError):
        subs = []
    for path in (*subs, data, os.path.join(step_dir, "ranks"), step_dir):
        tidy_dir(path)


def tidy_dir(path: str) -> None:
    """Remove the directory `path` if it is empty; one that is not, or is gone, stays as it is."""
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise


def place(spares: str, rank: int, tier: str, path: str) -> bool:
    """Rank `rank`'s own write of `path` in the local tier at `tier`
    (`<tier>/<step>/data/<rank>[.<token>]/<rel>`): rename its spare `<spares>/<rank>/<rel>`
    there, to be written over (`xckpt.native._fileio.recycle_under`). False when there is
    none, or `path` is not the rank's own."""
    parts = os.path.relpath(path, tier).split(os.sep)
    if len(parts) < 4 or not parts[0].isdigit() or parts[1] != "data" or parts[2].split(".")[0] != str(rank):
        return False
    try:
        os.rename(os.path.join(spares, str(rank), *parts[3:]), path)
    except OSError:
        return False  # none: a fresh file
    return True


class Mappings:
    """Shared mappings of the files replicas are received into, kept from round to round.

    Mapping a file costs the kernel a page-table entry per 4 KiB page (populating 32 MiB took
    5-6 ms on the 2-core test machine, a fifth of moving those bytes between two ranks). A
    file comes back every `local_keep + 1` rounds (see the module), so its mapping is kept
    that long and reused: the same file (device and inode, a number no other file has while
    the mapping holds this one) at the same size. A mapping no round used for longer is
    dropped. The process's RSS counts the mapped pages (they are the tier's, in memory
    either way).
    """

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self._held: dict[tuple[int, int], tuple[int, mmap.mmap, int]] = {}
        self._round = 0

    def map(self, fd: int, size: int) -> np.ndarray:
        """A writable uint8 array over the open file `fd`, cut to `size` bytes (it is, to send it)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        held = self._held.get(key)
        if held is None or held[0] != size or st.st_size != size:
            if st.st_size != size:
                os.ftruncate(fd, size)
            held = (size, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)), 0)
        self._held[key] = (size, held[1], self._round)
        return np.frombuffer(held[1], dtype=np.uint8)

    def next_round(self) -> None:
        """Drop the mappings no round used for `rounds` rounds."""
        self._round += 1
        self._held = {k: v for k, v in self._held.items() if v[2] >= self._round - self.rounds}

    def close(self) -> None:
        self._held.clear()


def claim(spares: str, source: int, name: str, path: str, size: int, maps: Mappings) -> np.ndarray | None:
    """The spare for file `name` (`data/<source>[.<token>]/<rel>`) of `source`'s replica,
    renamed to `path`, cut to `size` bytes and mapped (`maps`): a writable uint8 array over
    the file. None when there is no such spare or it cannot be used (the caller writes a
    fresh file)."""
    parts = name.split("/", 2)
    if len(parts) != 3 or size <= 0:
        return None
    spare = os.path.join(spares, str(source), parts[2])
    try:
        os.rename(spare, path)
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # none (or not usable): a fresh file
    try:
        return maps.map(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
