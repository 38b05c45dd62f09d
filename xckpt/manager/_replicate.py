"""Replication of local steps: each rank's part sent to ranks on other nodes (DESIGN.md section 11).

A rank's part of a local step is its files in the step's directory: `ranks/<r>.json`
and the data key space its manifest names (`data/<r>/`, or `data/<r>.<token>/`
after an overwrite). `Replicator` sends those bytes to the ranks
`xckpt.manager._tiers.replica_pairs` names, which write them under the same
names in their own local directory: a replica is a copy a reader cannot tell from the
original, with the writer's checksums (the manifest's own, each chunk's crc32).

Call protocol (`Replicator.run`, every rank of the manager's group, the manager's
local-tier thread, one step at a time):

1. each rank packs its part (a header of file names and sizes, then the bytes);
   one exchange of every rank's outcome of its local write and packing, with the
   payload sizes: when any failed, every rank raises (nothing is sent);
2. the ranks exchange the payloads (one `batch_isend_irecv`, on a gloo group of the
   replication's own, so it never interleaves with the training's or the manager's
   collectives);
3. each receiver writes the files, the data first and the rank manifest last (its
   checksum checked, a temporary name, then a rename): a kill part way leaves no
   manifest, so the copy is not counted. The data carry the writer's checksums, which
   every restore checks (a replica damaged in transit or at rest is found there);
4. a last exchange of outcomes: every rank returns once every replica of the step is
   stored, or every rank raises.

Every collective waits at most `TIMEOUT_S`; a rank that stopped makes the others
raise instead of hanging. Bytes travel as uint8 tensors, never pickles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from xckpt._wait import wait_works
from xckpt.errors import ManifestError, XckptError
from xckpt.manifest import parse_document

__all__ = ["Replicator", "pack", "unpack", "TIMEOUT_S"]

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


def pack(step_dir: str, rank: int) -> np.ndarray:
    """Rank `rank`'s part of the local step at `step_dir` as one uint8 buffer: an 8-byte
    header length, the header (JSON: each file's name and size), the files' bytes, the rank
    manifest last. The bytes carry their own checksums (each zarr chunk's crc32c, each
    packed chunk's crc32 and the manifest's SHA-256 in the manifest), which a restore
    checks on every read; the manifest's is checked on arrival too."""
    mkey = f"ranks/{rank}.json"
    with open(os.path.join(step_dir, mkey), "rb") as fh:
        mbytes = fh.read()
    files: list[tuple[str, int]] = []
    for d in _data_dirs(step_dir, rank):
        for base, _dirs, names in os.walk(os.path.join(step_dir, d)):
            for n in sorted(names):
                full = os.path.join(base, n)
                files.append((os.path.relpath(full, step_dir), os.path.getsize(full)))
    files.append((mkey, len(mbytes)))
    head = json.dumps({"files": [[n, size] for n, size in files]}).encode()
    out = np.empty(8 + len(head) + sum(size for _n, size in files), dtype=np.uint8)
    out[:8] = np.frombuffer(len(head).to_bytes(8, "little"), dtype=np.uint8)
    out[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = 8 + len(head)
    for name, size in files[:-1]:
        with open(os.path.join(step_dir, name), "rb") as fh:
            if fh.readinto(memoryview(out[pos : pos + size])) != size:
                raise XckptError(f"local step {step_dir!r}: {name} changed size while it was replicated")
        pos += size
    out[pos:] = np.frombuffer(mbytes, dtype=np.uint8)
    return out


def unpack(buf: np.ndarray, step_dir: str, src: int) -> None:
    """Write the part rank `src` sent (`pack`'s buffer) into `step_dir`: the data
    first, the rank manifest last, once its checksum is checked.

    Raises:
        XckptError: a damaged or malformed buffer (nothing of it counts as a copy).
    """
    where = f"the replica of rank {src}'s part of local step {step_dir!r}"
    try:
        n = int.from_bytes(buf[:8].tobytes(), "little")
        files = json.loads(buf[8 : 8 + n].tobytes())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise XckptError(f"{where}: its header cannot be read ({e}); nothing was written") from None
    mkey = f"ranks/{src}.json"
    if not files or files[-1][0] != mkey:
        raise XckptError(f"{where}: it does not end with {mkey}; nothing was written")
    old = os.path.join(step_dir, mkey)
    if os.path.exists(old):
        os.remove(old)  # a stale copy must not count while the new one is written
    pos = 8 + n
    made: set[str] = set()
    for name, size in files:
        parts = name.split("/")
        if name.startswith("/") or ".." in parts or not (parts[0] == "data" or name == mkey):
            raise XckptError(f"{where}: it names a file outside the step ({name!r}); nothing more was written")
        data = buf[pos : pos + size]
        if len(data) != size:
            raise XckptError(f"{where}: {name} is cut short; the copy was dropped")
        if name == mkey:
            try:
                parse_document(data.tobytes(), os.path.join(step_dir, mkey))
            except ManifestError as e:
                raise XckptError(f"{where}: its manifest is damaged ({e}); the copy was dropped") from None
        path = os.path.join(step_dir, name)
        folder = os.path.dirname(path)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        # data files in place (no manifest yet: the copy does not count until the last rename)
        tmp = f"{path}.tmp{os.getpid()}" if name == mkey else path
        with open(tmp, "wb") as fh:
            fh.write(memoryview(data))
        if tmp != path:
            os.replace(tmp, path)
        pos += size


class Replicator:
    """Sends this rank's local steps to its destinations and stores its sources' (see the module).

    Built on every rank at the same point (it makes a gloo group over the manager's group).
    """

    def __init__(self, process_group: Any, rank: int, world: int, pairs: Sequence[tuple[int, int]]) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        group = process_group if process_group is not None else dist.group.WORLD
        self._ranks = sorted(dist.get_process_group_ranks(group))
        self.group = dist.new_group(ranks=self._ranks, backend="gloo", use_local_synchronization=True)
        self.rank, self.world = rank, world
        self.dsts = [d for s, d in pairs if s == rank]
        self.srcs = [s for s, d in pairs if d == rank]
        #: Bytes this rank sent in its last replication (benchmarks read it).
        self.sent_bytes = 0

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

    def _exchange(self, sends: Sequence[tuple[int, Any]], recvs: Sequence[tuple[int, Any]], step: int) -> None:
        dist = self._dist
        ops = [dist.P2POp(dist.irecv, buf, self._ranks[s], self.group) for s, buf in recvs]
        ops += [dist.P2POp(dist.isend, buf, self._ranks[d], self.group) for d, buf in sends]
        if ops:
            self._wait(dist.batch_isend_irecv(ops), step, "replica")

    def run(self, step: int, step_dir: str, err: BaseException | None) -> None:
        """Replicate local step `step` (this rank's part is in `step_dir`); see the module."""
        torch = self._torch
        payload = torch.zeros(0, dtype=torch.uint8)
        if err is None and self.dsts:
            try:
                payload = torch.from_numpy(pack(step_dir, self.rank))
            except (OSError, XckptError) as e:
                err = e
        sizes = self._agree(err, step, "the local save", payload.numel())
        got = {s: torch.empty(sizes[s], dtype=torch.uint8) for s in self.srcs}
        self._exchange([(d, payload) for d in self.dsts], list(got.items()), step)
        self.sent_bytes = payload.numel() * len(self.dsts)
        fail: BaseException | None = None
        try:
            for s, buf in got.items():
                unpack(buf.numpy(), step_dir, s)
        except (OSError, XckptError) as e:
            fail = e
        self._agree(fail, step, "storing the replicas")
