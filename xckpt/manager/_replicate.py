"""Replication of local steps: each rank's part sent to ranks on other nodes (DESIGN.md section 11).

A rank's part of a local step is its files in the step's directory: `ranks/<r>.json`
and the data key space its manifest names (`data/<r>/`, or `data/<r>.<token>/`
after an overwrite). `Replicator` sends those bytes to the ranks
`xckpt.manager._tiers.replica_pairs` names, which write them under the same
names in their own local directory: a replica is a copy a reader cannot tell from the
original, with the writer's checksums (the manifest's own, each chunk's crc32).

Call protocol (`Replicator.run`, every rank of the manager's group, the manager's
local-tier thread, one step at a time):

1. each rank makes its part's head (`head`: a header of file names and sizes, the
   bytes of the files under `MAP_AT`, the rank manifest last); one exchange of every
   rank's outcome of its local write and of making the head, with the head sizes:
   when any failed, every rank raises (nothing is sent);
2. each sender posts its head, then the larger files in `CHUNK`-byte messages, all at
   once, straight from a mapping of its files (no copy of ours; a file the tier wrote
   over keeps its mapping from an earlier round), on a gloo group of the replication's
   own, so it never interleaves with the training's or the manager's collectives;
3. each receiver takes the head, writes its small files, and receives each larger file
   that has a spare (the same file in a step retention dropped, `xckpt.manager._spares`)
   straight into a mapping of the spare, renamed into the step: no write, and no page
   for the kernel to find. Any other file goes through `RECV_BUFFERS` reused buffers,
   one written to the file while the next ones arrive.
   A receiver that cannot write goes on receiving (its senders finish) and reports it
   in step 4;
4. each receiver writes the rank manifest last (its checksum checked, a temporary name,
   then a rename): a kill part way leaves no manifest, so the copy is not counted. The
   data carry the writer's checksums, which every restore checks (a replica damaged in
   transit or at rest is found there). A last exchange of outcomes: every rank returns
   once every replica of the step is stored, or every rank raises.

Every collective waits at most `TIMEOUT_S`; a rank that stopped makes the others
raise instead of hanging. Bytes travel as uint8 tensors, never pickles.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from xckpt._wait import wait_works
from xckpt.errors import XckptError
from xckpt.manifest import signed

from ._spares import Mappings, claim

__all__ = ["Replicator", "Incoming", "head", "map_file", "pack", "unpack", "TIMEOUT_S"]

#: Files of this many bytes or more travel as messages of their own, sent from and received
#: into a mapping of the file (no copy of ours); smaller ones in the head.
MAP_AT = 1 << 20
#: Bytes of one message of a larger file.
CHUNK = 4 << 20
#: Receive buffers of `CHUNK` bytes each receiver keeps (32 MiB): this many messages are
#: in flight while one is written, so a sender seldom waits on its receiver's writes. With
#: two, replication was 0.65-0.70x a plain send (`bench/tiers.py`); in a gloo test of 4
#: ranks sending 32 MiB each on the shared 2-core machine, eight gave 0.86x and two 0.75x
#: (medians of 15; receiving into a mapping of the file instead cost more CPU, in page faults).
RECV_BUFFERS = 8

#: Seconds any one exchange of a replication may wait for the other ranks.
TIMEOUT_S = 600.0


def _data_dirs(step_dir: str, rank: int) -> list[str]:
    """The data key spaces of rank `rank` in `step_dir`: `data/<rank>` or, after an
    overwrite, `data/<rank>.<token>` (the writer deletes the key spaces it replaced once
    its manifest is in place, so after a commit there is one)."""
    try:
        names = os.listdir(os.path.join(step_dir, "data"))
    except FileNotFoundError:
        return []
    return sorted(f"data/{n}" for n in names if n == str(rank) or n.startswith(f"{rank}."))


def _files(step_dir: str, rank: int) -> list[tuple[str, int]]:
    """Rank `rank`'s data files in `step_dir`: `(name relative to the step, size)`."""
    files: list[tuple[str, int]] = []
    for d in _data_dirs(step_dir, rank):
        for base, _dirs, names in os.walk(os.path.join(step_dir, d)):
            for n in sorted(names):
                full = os.path.join(base, n)
                files.append((os.path.relpath(full, step_dir), os.path.getsize(full)))
    return files


def head(step_dir: str, rank: int, inline_below: int | None = None) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """Rank `rank`'s part of the local step at `step_dir` as a head buffer and the files sent
    after it: an 8-byte header length, the header (JSON: each file's name, size and whether
    its bytes are in the head), the bytes of the files in the head, the rank manifest last.
    Files of `inline_below` bytes or more (None: none) are left out of the head, to be sent
    as messages of their own straight from the file. The bytes carry their own checksums
    (each zarr chunk's crc32c, each packed chunk's crc32 and the manifest's SHA-256 in the
    manifest), which a restore checks on every read; the manifest's is checked on arrival."""
    mkey = f"ranks/{rank}.json"
    with open(os.path.join(step_dir, mkey), "rb") as fh:
        mbytes = fh.read()
    files = _files(step_dir, rank)
    inline = [(n, size) for n, size in files if inline_below is None or size < inline_below]
    big = [(n, size) for n, size in files if not (inline_below is None or size < inline_below)]
    entries = [[n, size, 1] for n, size in inline] + [[n, size, 0] for n, size in big] + [[mkey, len(mbytes), 1]]
    hdr = json.dumps({"files": entries}).encode()
    out = np.empty(8 + len(hdr) + sum(size for _n, size in inline) + len(mbytes), dtype=np.uint8)
    out[:8] = np.frombuffer(len(hdr).to_bytes(8, "little"), dtype=np.uint8)
    out[8 : 8 + len(hdr)] = np.frombuffer(hdr, dtype=np.uint8)
    pos = 8 + len(hdr)
    for name, size in inline:
        with open(os.path.join(step_dir, name), "rb") as fh:
            if fh.readinto(memoryview(out[pos : pos + size])) != size:
                raise XckptError(f"local step {step_dir!r}: {name} changed size while it was replicated")
        pos += size
    out[pos:] = np.frombuffer(mbytes, dtype=np.uint8)
    return out, big


def pack(step_dir: str, rank: int) -> np.ndarray:
    """Rank `rank`'s part of the local step at `step_dir` as one uint8 buffer (`head`
    with every file in it)."""
    return head(step_dir, rank)[0]


def map_file(path: str, size: int, maps: Mappings) -> Any:
    """A uint8 tensor over the file at `path` (`size` bytes, read in full when mapped), so
    gloo sends straight from the page cache. The mapping is kept in `maps`: a file the tier
    wrote over, mapped in an earlier round, is not mapped again."""
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise XckptError(f"{path} changed size while it was replicated")
        return torch.from_numpy(maps.map(fd, size))
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class Incoming:
    """A part arriving from rank `src` into `step_dir`: `open(head)` checks the head and
    writes the files in it (the manifest kept back); the files that follow (`pending`:
    `(name, size)`) are received in chunks and written by `Replicator`; `close()` checks
    the manifest and writes it, last (a temporary name, then a rename)."""

    def __init__(self, step_dir: str, src: int) -> None:
        self.step_dir, self.src = step_dir, src
        self.where = f"the replica of rank {src}'s part of local step {step_dir!r}"
        self.pending: list[tuple[str, int]] = []
        self._manifest = b""

    def open(self, buf: np.ndarray) -> None:
        where, step_dir = self.where, self.step_dir
        try:
            n = int.from_bytes(buf[:8].tobytes(), "little")
            files = json.loads(buf[8 : 8 + n].tobytes())["files"]
            files = [(str(f[0]), int(f[1]), bool(f[2]) if len(f) > 2 else True) for f in files]
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise XckptError(f"{where}: its header cannot be read ({e}); nothing was written") from None
        mkey = f"ranks/{self.src}.json"
        if not files or files[-1][0] != mkey or not files[-1][2]:
            raise XckptError(f"{where}: it does not end with {mkey}; nothing was written")
        for name, size, _inline in files:
            parts = name.split("/")
            if name.startswith("/") or ".." in parts or not (parts[0] == "data" or name == mkey) or size < 0:
                raise XckptError(f"{where}: it names a file outside the step ({name!r}); nothing was written")
        # received in chunks after the head (`Replicator`), whatever happens here
        self.pending = [(name, size) for name, size, inline in files if not inline]
        old = os.path.join(step_dir, mkey)
        if os.path.exists(old):
            os.remove(old)  # a stale copy must not count while the new one is written
        pos = 8 + n
        made: set[str] = set()
        for name, size, inline in files:
            path = os.path.join(step_dir, name)
            folder = os.path.dirname(path)
            if folder not in made:
                os.makedirs(folder, exist_ok=True)
                made.add(folder)
            if not inline:
                continue
            data = buf[pos : pos + size]
            if len(data) != size:
                raise XckptError(f"{where}: {name} is cut short; the copy was dropped")
            pos += size
            if name == mkey:
                self._manifest = data.tobytes()
                continue
            with open(path, "wb") as fh:  # data in place: the copy does not count until the manifest
                fh.write(memoryview(data))

    def close(self) -> None:
        mkey = f"ranks/{self.src}.json"
        path = os.path.join(self.step_dir, mkey)
        if not signed(self._manifest):  # bytes only: no parse (see `signed`)
            raise XckptError(
                f"{self.where}: its manifest is damaged (it fails its checksum or has none); the copy was dropped"
            )
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(self._manifest)
        os.replace(tmp, path)


def unpack(buf: np.ndarray, step_dir: str, src: int) -> None:
    """Write the part rank `src` sent (`pack`'s buffer) into `step_dir`: the data
    first, the rank manifest last, once its checksum is checked.

    Raises:
        XckptError: a damaged or malformed buffer (nothing of it counts as a copy).
    """
    part = Incoming(step_dir, src)
    part.open(buf)
    if part.pending:
        raise XckptError(f"{part.where}: {part.pending[0][0]} is not in the buffer; the copy was dropped")
    part.close()


class Replicator:
    """Sends this rank's local steps to its destinations and stores its sources' (see the module).

    Built on every rank at the same point (it makes a gloo group over the manager's group).
    """

    def __init__(
        self,
        process_group: Any,
        rank: int,
        world: int,
        pairs: Sequence[tuple[int, int]],
        spares: str,
        keep: int,
    ) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        group = process_group if process_group is not None else dist.group.WORLD
        self._ranks = sorted(dist.get_process_group_ranks(group))
        self.group = dist.new_group(ranks=self._ranks, backend="gloo", use_local_synchronization=True)
        self.rank, self.world = rank, world
        self.dsts = [d for s, d in pairs if s == rank]
        self.srcs = [s for s, d in pairs if d == rank]
        #: Where this rank's spares are (`xckpt.manager._spares`).
        self.spares = spares
        self._maps = Mappings(keep + 1)
        #: Bytes this rank sent in its last replication, and received into spares (benchmarks read them).
        self.sent_bytes = self.reused_bytes = 0
        #: Seconds of its last replication: making its head, then from every rank's local
        #: write done (the first exchange) to every replica stored (the last).
        self.seconds = 0.0
        self._bufs: list[Any] = []

    def close(self) -> None:
        """Drop the receive buffers and the spares' mappings."""
        self._maps.close()
        self._bufs = []

    def _wait(self, works: Sequence[Any], step: int, what: str) -> None:
        wait_works(
            works,
            TIMEOUT_S,
            lambda e: f"replicating local step {step}: rank {self.rank} got no {what} within {TIMEOUT_S:g} s "
            f"({e}): another rank stopped (failed or was killed); the previous local step stays restorable",
        )

    def _agree(self, err: BaseException | None, step: int, what: str, size: int = 0) -> list[int]:
        """Every rank returns every rank's `size`, or every rank raises (this rank its own error)."""
        torch, dist = self._torch, self._dist
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        mine = torch.tensor([0 if err is None else 1, size], dtype=torch.int64)
        self._wait([dist.all_gather(out, mine, group=self.group, async_op=True)], step, f"outcome of {what}")
        if err is not None:
            raise err
        failed = [r for r, t in enumerate(out) if int(t[0])]
        if failed:
            raise XckptError(
                f"local step {step}: {what} failed on ranks {failed} (see their errors); the step is not "
                "counted and the previous local step stays restorable"
            )
        return [int(t[1]) for t in out]

    def _buffers(self) -> list[Any]:
        """`RECV_BUFFERS` receive buffers of `CHUNK` bytes, made (and touched) once per replicator."""
        if not self._bufs:
            self._bufs = [self._torch.zeros(CHUNK, dtype=self._torch.uint8) for _ in range(RECV_BUFFERS)]
        return self._bufs

    def _receive(self, incoming: dict[int, Incoming], step: int, write: bool) -> BaseException | None:
        """Receive the larger files of every incoming part in `CHUNK`-byte messages, posted in
        the order they are sent: a file with a spare (`xckpt.manager._spares`) straight into
        a mapping of it, any other through `RECV_BUFFERS` reused buffers, each written to its
        file while the next ones arrive. A failure to write stops the writing, never the
        receiving (the senders finish); it is returned."""
        mapped: dict[str, Any] = {}
        if write:
            for s, part in incoming.items():
                for name, size in part.pending:
                    path = os.path.join(part.step_dir, name)
                    arr = claim(self.spares, s, name, path, size, self._maps)
                    if arr is not None:
                        mapped[path] = self._torch.from_numpy(arr)
                        self.reused_bytes += size
        self._maps.next_round()
        jobs = [
            (s, os.path.join(part.step_dir, name), off, min(CHUNK, size - off))
            for s, part in incoming.items()
            for name, size in part.pending
            for off in range(0, max(size, 1), CHUNK)
        ]
        return self._through_buffers(jobs, mapped, step, None if write else XckptError("not written"))

    def _through_buffers(
        self, jobs: list[tuple[int, str, int, int]], mapped: dict[str, Any], step: int, fail: BaseException | None
    ) -> BaseException | None:
        """Post every job's receive in order: into its mapped file, or into the next free one of
        `RECV_BUFFERS` buffers, written to its file (unless `fail`) before the buffer is reused."""
        dist = self._dist
        bufs: list[Any] = []
        ring: collections.deque[tuple[Any, int, str, int]] = collections.deque()  # (work, buffer, path, bytes)
        direct: list[Any] = []
        fd, at, posted = -1, "", 0

        def drain() -> None:
            nonlocal fd, at, fail
            work, b, path, n = ring.popleft()
            if work is not None:
                self._wait([work], step, "replica")
            if fail is not None:
                return
            try:
                if path != at:
                    if fd >= 0:
                        os.close(fd)
                    fd, at = -1, path
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                _write_all(fd, memoryview(bufs[b].numpy())[:n])
            except OSError as e:
                fail = e

        try:
            for s, path, off, n in jobs:
                if path in mapped:
                    direct.append(dist.irecv(mapped[path][off : off + n], self._ranks[s], group=self.group))
                    continue
                if len(ring) == RECV_BUFFERS:
                    drain()
                bufs = bufs or self._buffers()
                b, posted = posted % RECV_BUFFERS, posted + 1  # the oldest in flight holds it when the ring is full
                ring.append((dist.irecv(bufs[b][:n], self._ranks[s], group=self.group) if n else None, b, path, n))
            while ring:
                drain()
            self._wait(direct, step, "replica")
        finally:
            if fd >= 0:
                os.close(fd)
        return fail

    def run(self, step: int, step_dir: str, err: BaseException | None) -> None:
        """Replicate local step `step` (this rank's part is in `step_dir`); see the module.

        The head (the small files and the manifest, in one message per destination), then
        the larger files in `CHUNK`-byte messages, sent straight from a mapping of the file
        and received into a mapping of a spare, or into `RECV_BUFFERS` reused buffers, each
        written to the copy while the next ones arrive."""
        torch, dist = self._torch, self._dist
        start = time.perf_counter()
        payload = torch.zeros(0, dtype=torch.uint8)
        big: list[tuple[str, int]] = []
        if err is None and self.dsts:
            try:
                buf, big = head(step_dir, self.rank, MAP_AT)
                payload = torch.from_numpy(buf)
            except (OSError, XckptError) as e:
                err = e
        made = time.perf_counter() - start
        sizes = self._agree(err, step, "the local save", payload.numel())
        t0, self.reused_bytes = time.perf_counter(), 0
        got = {s: torch.empty(sizes[s], dtype=torch.uint8) for s in self.srcs}
        heads = [dist.irecv(buf, self._ranks[s], group=self.group) for s, buf in got.items()]
        sends = [dist.isend(payload, self._ranks[d], group=self.group) for d in self.dsts]
        for n, size in big:  # each file's messages follow the head; they travel while the next one is mapped
            t = map_file(os.path.join(step_dir, n), size, self._maps)
            sends += [
                dist.isend(t[off : off + CHUNK], self._ranks[d], group=self.group)
                for d in self.dsts for off in range(0, t.numel(), CHUNK)
            ]
        self._wait(heads, step, "replica")
        fail: BaseException | None = None
        incoming = {}
        for s, buf in got.items():
            part = incoming[s] = Incoming(step_dir, s)
            try:
                part.open(buf.numpy())
            except (OSError, XckptError) as e:  # its files are still received (and dropped): the sender
                fail = e  # finishes (a header that cannot be read names none: its sender waits TIMEOUT_S)
        failed = self._receive(incoming, step, write=fail is None)
        self._wait(sends, step, "replica")
        self.sent_bytes = (payload.numel() + sum(size for _n, size in big)) * len(self.dsts)
        fail = fail or failed
        if fail is None:
            try:
                for part in incoming.values():
                    part.close()
            except (OSError, XckptError) as e:
                fail = e
        self._agree(fail, step, "storing the replicas")
        self.seconds = made + time.perf_counter() - t0
