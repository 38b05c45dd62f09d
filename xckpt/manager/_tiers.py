"""The local tier: every few steps, each rank's part in node-local storage (DESIGN.md section 11).

A manager built with `local=` keeps, beside its persistent root, a directory on the
node (`/dev/shm/...`, a local NVMe disk) that the ranks of one node share. Every
`local_every` steps each rank saves its part there as an ordinary xckpt checkpoint
layout, `<local>/<step>/ranks/<r>.json` and `data/<r>/` (a rank-local save, from
the manager's staging buffers), and sends a copy to `replicas` ranks on other nodes,
which write it into their own local directory under the same names
(`xckpt.manager._replicate`). A node's directory thus holds its own ranks' parts
and the replicas it keeps for others, all in one layout, and every copy carries the
checksums the writer made (the rank manifest's own, the chunks' crc32s).

Call protocol (the manager's, every rank in the same order):

1. construction: every rank builds its `Tiers` at the same point; the ranks
   exchange what their local directories hold (`local_steps` starts from it) and
   rank 0 writes the root's tier record (`tiers.json`, read by `xckpt ls`);
2. `save(step, ...)` when `due(step)`: the previous local round finishes first
   (its error is raised here), then the write of a persistent save in flight (the two
   share the staging buffers); the state is staged and `save` returns. The round
   then runs on the tier's thread: the write (data, then the rank manifest), the
   replication, and once every rank has its part and its replicas of the step stored
   (the replication's last exchange), the node's first rank writes the step's merged
   manifest (`xckpt.manager._merged`, what a restore reads instead of merging the rank
   manifests), then retention: local steps older than the newest `local_keep` complete
   ones are dropped, each rank releasing what it owns of them, manifests first, its data
   files kept as spares that the next step writes over (`xckpt.manager._spares`);
3. `wait()` finishes the round in flight; `restore` is `xckpt.manager._fetch`.

A kill at any point leaves the previous local step restorable: a rank manifest is
written after its data (by the writer, and by the replication), a step's round deletes
older steps only after every rank finished it, and a rank's copy without its manifest
is not counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import Any

from xckpt.errors import ManifestError, XckptError
from xckpt.manifest import parse_claim, parse_document, parse_header, signed_header
from xckpt.native._fileio import read_mapped_under, recycle_under
from xckpt.native.steps import MANAGER_KEY, TIERS_KEY
from xckpt.storage import Location, Storage, location_name, location_spec

from ._adapters import start_save
from ._coord import Coordinator
from ._merged import drop_merged, write_merged
from ._policy import positive_count
from ._replicate import Replicator
from ._spares import SPARE_DIR, clear, place, release, tidy, tidy_dir
from ._staging import HostBuffers

__all__ = ["Held", "Tiers", "nodes_of", "replica_pairs"]


def nodes_of(world: int, ranks_per_node: int) -> list[list[int]]:
    """The nodes: consecutive groups of `ranks_per_node` ranks (the last may be smaller)."""
    return [list(range(s, min(s + ranks_per_node, world))) for s in range(0, world, ranks_per_node)]


def replica_pairs(world: int, ranks_per_node: int, replicas: int) -> list[tuple[int, int]]:
    """`(source, destination)` of every replication: the rank at position `i` of node
    `n` sends to position `i` (modulo its size) of nodes `n+1 .. n+replicas` (modulo
    the node count), so every copy lands on another node. One node: none."""
    nodes = nodes_of(world, ranks_per_node)
    out = []
    for n, members in enumerate(nodes):
        for i, r in enumerate(members):
            for k in range(1, min(replicas, len(nodes) - 1) + 1):
                other = nodes[(n + k) % len(nodes)]
                out.append((r, other[i % len(other)]))
    return out


@dataclass(frozen=True)
class Held:
    """One rank's part of a local step, as a local directory holds it (its own or a replica)."""

    step: int
    rank: int
    save_id: str
    world_size: int
    when: float = 0.0  # the manifest's modification time (which of two complete saves is newer)


def _rmtree(path: str) -> None:
    """Delete a step directory, its manifests first. The other ranks of the node delete it
    too, at the same time: an entry one of them removed first is no error, and this
    returns once the directory is gone (any other failure is raised)."""

    def gone_meanwhile(fn: Any, p: str, exc: Any) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        if not isinstance(err, FileNotFoundError):
            raise err

    for sub in (os.path.join(path, "ranks"), path):
        for _ in range(50):
            shutil.rmtree(sub, onerror=gone_meanwhile)
            if not os.path.exists(sub):
                break
            time.sleep(0.01)  # another rank's delete of an entry is under way
        else:
            raise XckptError(f"local step {path!r}: {sub!r} could not be deleted (something keeps writing it)")


def _local_dir(local: Location, root: Location) -> str:
    """The local tier's directory (absolute), checked: a local directory, not the root.

    Raises:
        XckptError: `local` is not a local directory, or it is the manager's root.
    """
    location_spec(local)
    path = Storage(local).root
    if path is None:
        raise XckptError(
            f"local={location_name(local)!r} is not a node-local directory: the local tier is a directory "
            "on each node (/dev/shm/<job>, a local NVMe disk); persistent storage is the manager's root"
        )
    rootdir = Storage(root).root
    if rootdir is not None and os.path.realpath(rootdir) == os.path.realpath(path):
        raise XckptError(
            f"local={location_name(local)!r} is the manager's root: local steps and persistent steps would "
            "share step directories; give the local tier a directory of its own (/dev/shm/<job>, a local disk)"
        )
    return os.path.abspath(path)


class Tiers:
    """A manager's local tier and its replication (see the module).

    Args:
        root: the manager's persistent root (rank 0 writes the tier record there).
        local: this node's directory (or `file://` URL).
        local_every, local_keep, replicas, ranks_per_node: as for the manager.
        coord: the manager's coordinator; `run`: the manager's run token.
        process_group: the manager's torch group (replication builds a gloo group over it).
    """

    def __init__(
        self,
        root: Location,
        local: Location,
        *,
        local_every: int | None,
        local_keep: int,
        replicas: int,
        ranks_per_node: int | None,
        coord: Coordinator,
        run: str,
        process_group: Any,
    ) -> None:
        self.every = positive_count("local_every", local_every) or 1
        self.keep = positive_count("local_keep", local_keep) or 1
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise XckptError(f"replicas must be an integer >= 0, got {replicas!r}")
        self.dir = _local_dir(local, root)
        os.makedirs(self.dir, exist_ok=True)
        self.root, self.coord, self.run, self.pg = root, coord, run, process_group
        world, self.rank = coord.world, coord.rank
        env = os.environ.get("LOCAL_WORLD_SIZE")
        rpn = ranks_per_node if ranks_per_node is not None else int(env) if env else world
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
            raise XckptError(f"ranks_per_node must be an integer >= 1, got {rpn!r}")
        self.ranks_per_node = min(rpn, world)
        self.nodes = nodes_of(world, self.ranks_per_node)
        self.pairs = replica_pairs(world, self.ranks_per_node, replicas)
        if replicas > len(self.nodes) - 1 and len(self.nodes) > 1:
            raise XckptError(
                f"replicas={replicas} needs {replicas + 1} nodes, the job has {len(self.nodes)} "
                f"({world} ranks, {self.ranks_per_node} per node); pass replicas <= {len(self.nodes) - 1}"
            )
        if replicas and len(self.nodes) == 1 and self.rank == 0:
            warnings.warn(
                f"the local tier at {self.dir!r} is not replicated: all {world} ranks are on one node "
                f"(ranks_per_node={self.ranks_per_node}), so there is no other node to hold copies; a lost "
                "node loses its local steps (the persistent root still has the persistent ones)",
                RuntimeWarning,
                stacklevel=3,
            )
        self.replicas = replicas
        #: The ranks whose replicas this rank receives, and where it keeps the files it owns in
        #: the steps retention drops, for the next step to reuse (`xckpt.manager._spares`).
        self.sources = [s for s, d in self.pairs if d == self.rank]
        self.spares = os.path.join(self.dir, SPARE_DIR, str(self.rank))
        self._tidy_spares()
        recycle_under(self.dir, functools.partial(place, self.spares, self.rank, self.dir))
        # a restore copies the tier's files out of mappings (3x preadv's speed on tmpfs here);
        # nothing shortens a step's files while one is read (see `read_mapped_under`)
        read_mapped_under(self.dir, True)
        self._mapped = True
        self.rep = (
            Replicator(process_group, coord.rank, world, self.pairs, spares=self.spares, keep=self.keep)
            if coord.kind == "torch" else None
        )
        self._pool: cf.ThreadPoolExecutor | None = None
        self._round: cf.Future[None] | None = None
        self._round_step: int | None = None
        self._written = threading.Event()
        self._written.set()
        self._n = 0
        self._lock = threading.Lock()
        held, _problems = self.scan()
        everyone = coord.gather([astuple(h) for h in held])
        #: Steps complete in the union of the local tiers (this run's rounds added as they finish).
        self._steps = set(complete_steps([Held(*t) for rows in everyone for t in rows]))
        self._older = set(self._steps)  # steps of earlier runs (kept until this run has enough)
        self._released: set[int] = set()  # dropped steps whose directory outlived this rank's release
        self._mine: list[int] = []  # this run's completed rounds
        hosts = coord.gather((socket.gethostname(), self.dir))
        #: Per rank, its node's directory: ranks with the same one read the same copies.
        self.places: list[tuple[str, str]] = [tuple(h) for h in hosts]
        if self.rank == 0:
            self._record(hosts)

    # -- what the local directory holds ------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dir, str(step))

    def scan(self, keep: dict[tuple[int, int, str], bytes] | None = None) -> tuple[list[Held], list[str]]:
        """Every rank part this node's directory holds (manifest checksum verified; only the
        header parsed, `signed_header`), and the problems found (a damaged manifest: named,
        never counted). `keep`, when given, gets each part's manifest bytes by
        `(step, rank, save_id)`, so a restore does not read a manifest twice."""
        held, problems = [], []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return [], []
        for name in names:
            if not (name.isascii() and name.isdigit()) or len(name) > 18:
                continue
            ranks_dir = os.path.join(self.dir, name, "ranks")
            try:
                files = os.listdir(ranks_dir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for f in files:
                stem = f[:-5]
                if not (f.endswith(".json") and stem.isascii() and stem.isdigit() and len(stem) < 8):
                    continue
                where = os.path.join(ranks_dir, f)
                try:
                    with open(where, "rb") as fh:
                        data = fh.read()
                        when = os.fstat(fh.fileno()).st_mtime
                    if parse_claim(data, where) is not None:
                        continue  # a save that did not commit: not a copy
                    h = signed_header(data, where) or parse_header(parse_document(data, where), where)
                    if h.rank != int(stem):
                        raise ManifestError(f"{where} says it is rank {h.rank}")
                except FileNotFoundError:
                    continue  # deleted by another rank's retention meanwhile
                except (ManifestError, OSError) as e:
                    problems.append(f"local step {name}, rank {stem}'s part on rank {self.rank}: {e}")
                    continue
                held.append(Held(int(name), h.rank, h.save_id, h.world_size, when))
                if keep is not None:
                    keep[(int(name), h.rank, h.save_id)] = data
        return held, problems

    def steps(self) -> list[int]:
        """The local steps the job holds: complete in the union of the local tiers when the
        manager was built, plus this run's finished rounds, less the steps retention deleted."""
        with self._lock:
            return sorted(self._steps)

    # -- saving --------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def wait_written(self) -> None:
        """Return once the local write in flight stopped reading the staging buffers."""
        self._written.wait()

    def save(
        self, step: int, state: Any, kind: str, staging: HostBuffers, busy: cf.Future[Any] | None
    ) -> None:
        """Stage `state` as local step `step` and start its round (see the module).

        `busy`: the persistent save in flight, whose write reads the staging buffers.
        """
        self.finish()
        if busy is not None:
            cf.wait([busy])
        self._n += 1
        d = self.step_dir(step)
        mine = os.path.join(d, "ranks", f"{self.rank}.json")
        meta = {MANAGER_KEY: {"step": step, "metrics": None, "saved_at": time.time(), "tier": "local"}}
        overwrite = os.path.exists(mine)
        drop_merged(d)  # a merged manifest of an earlier save of this step (the writer would refuse it)
        save_id = f"local-{step}-{self.run}-{self._n}"
        # No row comparison while staging a local step: its writer stores whole chunks, and
        # the next persistent save finds the buffers refilled since its base (the staging's
        # generation), so it uses no rows found here either; comparing would only lengthen
        # the stall.
        rows_for, staging.rows_for = staging.rows_for, None
        try:
            finish = start_save(
                kind,
                state,
                d,
                save_id=save_id,
                overwrite=overwrite,
                metadata=meta,
                staging=staging,
                async_save=True,
                process_group=self.pg,
                rank_local=True,
            )
        finally:
            staging.rows_for = rows_for
        self._written.clear()
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="xckpt-local")
        self._round_step = step
        self._round = self._pool.submit(self._run_round, step, finish, save_id)

    def _run_round(self, step: int, finish: Callable[[], Any], save_id: str) -> None:
        err: BaseException | None = None
        try:
            finish()
        except Exception as e:  # every rank learns of it in the replication's first exchange
            err = e
        finally:
            self._written.set()
        if self.rep is not None:
            self.rep.run(step, self.step_dir(step), err)
            self._merge(step, save_id)
        elif err is not None:
            raise err
        with self._lock:
            self._steps.add(step)
            self._mine.append(step)
        self._prune()
        if self.rank == 0:
            self._record(None, latest=step)

    def _merge(self, step: int, save_id: str) -> None:
        """The node's first rank: the step's merged manifest, once every copy of it is stored
        (`xckpt.manager._merged`); a failure is a warning (a restore merges the rank manifests)."""
        if not any(members[0] == self.rank for members in self.nodes):
            return
        try:
            write_merged(self.step_dir(step), save_id, self.coord.world)
        except (XckptError, OSError) as e:
            warnings.warn(
                f"local step {step}: the merged manifest could not be written in {self.step_dir(step)!r} ({e}); "
                "a restore of it merges the rank manifests instead",
                RuntimeWarning,
                stacklevel=2,
            )

    def finish(self) -> None:
        """Wait for the round in flight; raise its error (naming the step)."""
        fut, step = self._round, self._round_step
        self._round = self._round_step = None
        if fut is None:
            return
        try:
            fut.result()
        except Exception as e:
            e.add_note(f"(raised by the local save of step {step} to {self.dir!r})")
            raise

    def close(self) -> None:
        """Finish the round in flight; delete this rank's spares and what is left of the steps
        retention dropped (another rank still releasing one only finds less to move)."""
        try:
            self.finish()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        recycle_under(self.dir, None)
        if self._mapped:
            read_mapped_under(self.dir, False)
            self._mapped = False
        if self.rep is not None:
            self.rep.close()
        for s in sorted(self._released):
            _rmtree(self.step_dir(s))
        self._released.clear()
        clear(self.spares)
        tidy_dir(os.path.dirname(self.spares))

    # -- retention and the record ------------------------------------------------------

    def _prune(self) -> None:
        """Drop local steps older than the newest `keep` complete ones (this run's rounds, and
        steps of earlier runs older than them). Every rank finished the newest round, so no
        rank still writes a step dropped here. A rank releases what it owns of a dropped step
        (`xckpt.manager._spares`: its part, and its replicas, kept as spares), manifests
        first; a directory that outlives the release (another rank of the node still releasing,
        or what no rank owns) is deleted in the next round, when every rank is done with it."""
        with self._lock:
            mine = sorted(self._mine)
            older = sorted(s for s in self._older if s < mine[0]) if mine else []
            kept = sorted(older + mine)[-self.keep :]
            floor = kept[0]
            try:
                names = os.listdir(self.dir)
            except FileNotFoundError:
                names = []
            doomed = [int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 18 and int(n) < floor]
            for s in doomed:
                self._steps.discard(s)
            self._mine = [s for s in self._mine if s >= floor]
        for s in sorted(doomed):
            d = self.step_dir(s)
            if s in self._released:
                _rmtree(d)
                self._released.discard(s)
                continue
            drop_merged(d)  # manifests first: the merged one, then each part's before its data
            release(d, self.rank, self.sources, self.spares)
            tidy(d)
            if os.path.exists(d):
                self._released.add(s)

    def _tidy_spares(self) -> None:
        """At construction: drop this rank's spares of an earlier run; the node's first rank
        also drops those of ranks that are not on the node now."""
        base = os.path.join(self.dir, SPARE_DIR)
        clear(os.path.join(base, str(self.rank)))
        node = next(m for m in self.nodes if self.rank in m)
        if node[0] == self.rank and os.path.isdir(base):
            for n in os.listdir(base):
                if not (n.isascii() and n.isdigit() and int(n) in node):
                    clear(os.path.join(base, n))

    def _record(self, hosts: list[tuple[str, str]] | None, latest: int | None = None) -> None:
        """Rank 0: the root's `tiers.json`, which tells `xckpt ls ROOT` where local steps are."""
        storage = Storage(self.root)
        try:
            if hosts is None:
                old = storage.read_key(TIERS_KEY)
                doc = json.loads(old) if old is not None else {}
            else:
                doc = {
                    "format": "xckpt-tiers",
                    "version": 1,
                    "nodes": [
                        {"ranks": members, "host": hosts[members[0]][0], "local": hosts[members[0]][1]}
                        for members in self.nodes
                    ],
                    "local_every": self.every,
                    "local_keep": self.keep,
                    "replicas": self.replicas,
                    "ranks_per_node": self.ranks_per_node,
                    "world_size": self.coord.world,
                }
            doc["updated_at"] = time.time()
            doc["local_steps"] = self.steps()
            if latest is not None:
                doc["latest_local_step"] = latest
            storage.write_key(TIERS_KEY, json.dumps(doc, sort_keys=True).encode())
        except (XckptError, OSError, ValueError) as e:
            warnings.warn(
                f"could not write the tier record {TIERS_KEY} of {location_name(self.root)!r} ({e}); local "
                "saves go on, only `xckpt ls` will not say where they are",
                RuntimeWarning,
                stacklevel=2,
            )


def complete_steps(held: list[Held]) -> list[int]:
    """The steps whose parts `0..W-1` of one save are all held somewhere."""
    return sorted(s for s, (full, _sid, _w) in coverage(held).items() if full)


def coverage(held: list[Held]) -> dict[int, tuple[bool, str, int]]:
    """Per step, the save whose parts are best covered: `(complete, save_id, world_size)`;
    a complete save first, then the most parts, then the most recently written."""
    by: dict[tuple[int, str, int], set[int]] = {}
    when: dict[tuple[int, str, int], float] = {}
    for h in held:
        if 0 <= h.rank < h.world_size:
            key = (h.step, h.save_id, h.world_size)
            by.setdefault(key, set()).add(h.rank)
            when[key] = max(when.get(key, 0.0), h.when)
    best: dict[int, tuple[tuple[bool, int, float, str], int]] = {}
    for (step, sid, w), ranks in by.items():
        score = (len(ranks) == w, len(ranks), when[(step, sid, w)], sid)
        if step not in best or score > best[step][0]:
            best[step] = (score, w)
    return {s: (score[0], score[3], w) for s, (score, w) in best.items()}


def holders_of(everyone: Mapping[int, list[Held]], step: int, save_id: str) -> dict[int, set[int]]:
    """Per saved rank of `step`'s save `save_id`, the current ranks holding a copy."""
    out: dict[int, set[int]] = {}
    for r, held in everyone.items():
        for h in held:
            if h.step == step and h.save_id == save_id:
                out.setdefault(h.rank, set()).add(r)
    return out
