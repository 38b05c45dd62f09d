"""``xckpt.torch.load(..., read_once=True)``: each stored range read by one rank, sent to the others.

When several ranks need the same stored bytes (replicated tensors, data-parallel
replicas of a sharded layout), reading them from storage once per rank multiplies
what storage serves by the replication factor. With ``read_once`` the ranks of the
process group agree on a plan in which every stored range is read by exactly one
of the ranks that need it, which sends it to the others over the process group;
storage serves about one copy of what the group needs.

The plan (:func:`make_plan`, pure arithmetic over boxes, computed identically on
every rank from every rank's requests):

* per tensor and saved chunk, the part each rank needs (``plan_reads``). A part
  only one rank needs is read by that rank straight into its target, as without
  ``read_once`` (``Plan.solo``);
* parts several ranks need are cut into *cells* along every rank's part bounds and
  along the chunk's zarr grid (the unit storage reads whole), or, without a grid,
  into slabs of at most ``MAX_CELL_BYTES``; each cell lies in or out of each rank's
  part, so each rank receives exactly the cells it needs;
* cells that cost the same storage read (the same key of ``Source.read_units``:
  one zarr chunk, one packed span) form a *group*, read by one rank in one read per
  chunk (the bounding box of its cells), so no stored unit is read twice;
* each group's reader is one of the ranks that need it, chosen greedily to even
  out the bytes each rank reads, sends and receives; groups are cut, in order, into
  *rounds* of at most ``ROUND_BYTES`` per rank (host memory stays bounded).

Call protocol (:func:`load_once`, every rank of the group, same order):

1. one exchange of every rank's requests, or of its failure so far (a target that
   does not fit, a missing name, ...), with a :func:`fingerprint` of the checkpoint
   it opened: all ranks raise if any rank failed or opened another checkpoint;
2. each rank reads its solo parts;
3. per round: the reader of each group reads it and copies its cells to its own
   targets and to one send buffer per destination; one exchange of outcomes (a
   failed read, e.g. a corrupt chunk, fails every rank); one batch of
   point-to-point sends and receives (``batch_isend_irecv``: measured faster than
   ``all_to_all_single`` and than one broadcast per reader on gloo, and a buffer
   every destination needs alike is sent from one copy); each rank copies what it
   received into its targets;
4. a last exchange of outcomes.

Every collective is waited for with ``TIMEOUT_S``: a rank that stops (killed, or
stuck outside ``load``) makes the others raise an :class:`~xckpt.errors.XckptError`
instead of hanging. The exchanges carry bytes and int64 arrays, never pickles. On
NCCL the buffers travel through the current CUDA device.
"""

from __future__ import annotations

import datetime
import functools
import math
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt._progress import progress
from xckpt.errors import XckptError
from xckpt.manifest import Chunk, TensorEntry
from xckpt.source import Source
from xckpt.torch._dist import distributed, raise_for_ranks
from xckpt.torch._dtypes import torch_dtype
from xckpt.torch._pipeline import ALIGN, Copier, DeviceRing, wait_all

__all__ = ["Need", "Cell", "Group", "Plan", "make_plan", "load_once"]

#: Bytes one rank reads, sends and receives in one round at most (a larger group has a round to itself).
ROUND_BYTES = 256 << 20
#: Cells of a chunk without a zarr grid are cut into slabs of at most this many bytes (spreads reads).
MAX_CELL_BYTES = 16 << 20
#: Seconds any one collective of a read_once load may wait for the other ranks.
TIMEOUT_S = 600.0

#: A rank's target part: (tensor name, global box, numpy view or torch tensor of the box's shape).
Target = tuple[str, L.Box, Any]


@dataclass(frozen=True)
class Need:
    """One box of tensor ``name`` that a rank loads."""

    name: str
    box: L.Box


@dataclass(frozen=True)
class Cell:
    """Box ``box`` of tensor ``name``, needed by ``ranks``; it lies in read ``read`` of its group."""

    name: str
    box: L.Box
    itemsize: int
    ranks: tuple[int, ...]
    read: int

    @property
    def nbytes(self) -> int:
        return self.box.volume * self.itemsize


@dataclass(frozen=True)
class Group:
    """Cells that cost one storage read: ``reader`` reads ``reads`` (each inside one
    saved chunk) and sends each cell to the other ranks that need it."""

    reader: int
    reads: tuple[tuple[str, L.Box, int], ...]  # (name, box, itemsize)
    cells: tuple[Cell, ...]

    def read_bytes(self) -> int:
        return sum(b.volume * i for _n, b, i in self.reads)


@dataclass(frozen=True)
class Plan:
    """``solo[r]``: the (name, box) rank r reads for itself alone; ``rounds``: the groups,
    round by round."""

    solo: tuple[tuple[tuple[str, L.Box], ...], ...]
    rounds: tuple[tuple[Group, ...], ...]

    def group_read_bytes(self, rank: int) -> int:
        """Bytes (as loaded) rank ``rank`` reads for the groups it reads."""
        return sum(g.read_bytes() for rnd in self.rounds for g in rnd if g.reader == rank)


# -- the plan (pure) ---------------------------------------------------------------------------


def _cuts(lo: int, hi: int, step: int, origin: int) -> list[int]:
    """Multiples of ``step`` from ``origin`` strictly inside (lo, hi)."""
    first = origin + (-(-(lo + 1 - origin) // step)) * step
    return list(range(first, hi, step))


def _lattice(
    parts: Sequence[tuple[int, L.Box]], chunk: Chunk, itemsize: int, max_cell: int
) -> list[tuple[L.Box, tuple[int, ...]]]:
    """The cells of the parts ``(rank, box)`` of one chunk and the ranks needing each."""
    holders: dict[L.Box, set[int]] = {}
    for r, b in parts:
        holders.setdefault(b, set()).add(r)
    boxes = list(holders)  # replicas ask for the same box: the lattice is over distinct ones
    ndim = len(chunk.shape)
    lo = [min(b.offset[d] for b in boxes) for d in range(ndim)]
    hi = [max(b.end[d] for b in boxes) for d in range(ndim)]
    bounds: list[list[int]] = []
    for d in range(ndim):
        cuts = {lo[d], hi[d]}
        for b in boxes:
            cuts.update((b.offset[d], b.end[d]))
        if chunk.grid is not None:
            cuts.update(_cuts(lo[d], hi[d], max(1, chunk.grid[d]), chunk.offset[d]))
        elif d == 0:
            slab = math.prod(h - lo_ for lo_, h in zip(lo[1:], hi[1:])) * itemsize
            cuts.update(_cuts(lo[0], hi[0], max(1, max_cell // max(1, slab)), lo[0]))
        bounds.append(sorted(c for c in cuts if lo[d] <= c <= hi[d]))
    # per dim and interval: which boxes cover it (a bit per box)
    covers: list[list[tuple[int, int, int]]] = []
    for d in range(ndim):
        spans = []
        for a, z in zip(bounds[d], bounds[d][1:]):
            mask = 0
            for k, b in enumerate(boxes):
                if b.offset[d] <= a and z <= b.end[d]:
                    mask |= 1 << k
            spans.append((a, z, mask))
        covers.append(spans)
    out = []
    every = (1 << len(boxes)) - 1
    ranks_of: dict[int, tuple[int, ...]] = {}
    for combo in _product(covers):
        mask = every
        for _a, _b, m in combo:
            mask &= m
        if not mask:
            continue
        ranks = ranks_of.get(mask)
        if ranks is None:
            ranks = ranks_of[mask] = tuple(
                sorted(set().union(*(holders[b] for k, b in enumerate(boxes) if mask >> k & 1)))
            )
        out.append((L.Box(tuple(a for a, _b, _m in combo), tuple(b - a for a, b, _m in combo)), ranks))
    return out


def _product(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    for row in rows:
        out = [p + (x,) for p in out for x in row]
    return out


def _units_of(
    read_units: Callable[[str, Chunk, L.Box, int], Mapping[Hashable, int]],
    name: str,
    chunk: Chunk,
    itemsize: int,
    box: L.Box,
) -> Mapping[Hashable, int]:
    return read_units(name, chunk, box, itemsize)


def _shared_parts(
    parts: Sequence[tuple[int, L.Box]], units: Callable[[L.Box], Mapping[Hashable, int]]
) -> set[L.Box]:
    """The boxes among ``parts`` (of one chunk) that another rank needs too, or whose
    storage units another rank's part costs as well; every other part is read by its
    rank alone, straight into its target."""
    owners: dict[L.Box, set[int]] = {}
    for r, b in parts:
        owners.setdefault(b, set()).add(r)
    boxes = list(owners)
    keys = [set(units(b)) for b in boxes]
    shared = set()
    for i, b in enumerate(boxes):
        if len(owners[b]) > 1:
            shared.add(b)
            continue
        for j, c in enumerate(boxes):
            if j != i and owners[c] != owners[b] and (b.intersect(c) is not None or keys[i] & keys[j]):
                shared.add(b)
                break
    return shared


def _bbox(a: L.Box, b: L.Box) -> L.Box:
    off = tuple(min(x, y) for x, y in zip(a.offset, b.offset))
    end = tuple(max(x, y) for x, y in zip(a.end, b.end))
    return L.Box(off, tuple(e - o for o, e in zip(off, end)))


def make_plan(
    entry: Callable[[str], TensorEntry],
    read_units: Callable[[str, Chunk, L.Box, int], Mapping[Hashable, int]],
    needs: Sequence[Sequence[Need]],
    *,
    round_bytes: int = ROUND_BYTES,
    max_cell: int = MAX_CELL_BYTES,
    holders: Callable[[str, int], frozenset[int] | None] | None = None,
) -> Plan:
    """Who reads what and sends it to whom (see the module); the same on every rank.

    Args:
        entry: a tensor's entry by name (``Source.info``).
        read_units: ``Source.read_units``: the storage units a box of a chunk costs.
        needs: per rank, the boxes it loads.
        round_bytes, max_cell: see :data:`ROUND_BYTES`, :data:`MAX_CELL_BYTES`.
        holders: the ranks able to read chunk ``i`` of tensor ``name`` (None: every
            rank; a source whose copies live on some ranks only, the checkpoint
            manager's local tiers, says which). A part is read by a rank that needs
            it and holds it when there is one, else by a holder, which sends it.
    """
    world = len(needs)
    by_chunk: dict[tuple[str, int], list[tuple[int, L.Box]]] = {}
    # replicas send the same requests (load_once decodes them into one list): planned once
    alike: dict[int, tuple[Sequence[Need], list[int]]] = {}
    for r, rank_needs in enumerate(needs):
        alike.setdefault(id(rank_needs), (rank_needs, []))[1].append(r)
    for rank_needs, same in alike.values():
        for need in rank_needs:
            for req in L.plan_reads(entry(need.name).boxes, need.box):
                by_chunk.setdefault((need.name, req.chunk), []).extend((r, req.box) for r in same)
    solo: list[list[tuple[str, L.Box]]] = [[] for _ in range(world)]
    # Cells join one group when they cost a storage unit in common (union-find over the
    # units: a packed tensor straddling two packed spans joins their groups).
    owner: dict[Hashable, int] = {}  # storage unit -> a group id
    parent: list[int] = []
    placed: list[tuple[int, tuple[str, int], L.Box, tuple[int, ...], int]] = []

    def find(gid: int) -> int:
        while parent[gid] != gid:
            parent[gid] = parent[parent[gid]]
            gid = parent[gid]
        return gid

    holding: dict[int, frozenset[int] | None] = {}  # group id -> the ranks holding all its chunks
    for (name, ci), parts in by_chunk.items():
        hold = None if holders is None else holders(name, ci)
        if all(r == parts[0][0] for r, _b in parts) and (hold is None or parts[0][0] in hold):
            solo[parts[0][0]].extend((name, b) for _r, b in parts)
            continue
        t = entry(name)
        chunk, itemsize = t.chunks[ci], t.np_dtype.itemsize
        first = parts[0][1]
        if all(b == first for _r, b in parts) and chunk.grid is None and first.volume * itemsize <= max_cell:
            # replicas of one small stored piece (many small tensors): one cell
            pieces = [(first, tuple(sorted({r for r, _b in parts})))]
        else:
            shared = _shared_parts(parts, functools.partial(_units_of, read_units, name, chunk, itemsize))
            for r, b in parts:
                if b not in shared and (hold is None or r in hold):
                    solo[r].append((name, b))
            if hold is not None:
                shared |= {b for r, b in parts if r not in hold}
            parts = [(r, b) for r, b in parts if b in shared]
            pieces = _lattice(parts, chunk, itemsize, max_cell) if parts else []
        for box, ranks in pieces:
            keys = list(read_units(name, chunk, box, itemsize)) or [("cell", name, ci, box)]
            roots = sorted({find(owner[k]) for k in keys if k in owner})
            if roots:
                gid = roots[0]
                for other in roots[1:]:
                    parent[other] = gid
                    holding[gid] = _meet(holding.get(gid), holding.pop(other, None))
            else:
                gid = len(parent)
                parent.append(gid)
            holding[gid] = _meet(holding.get(gid), hold)
            for k in keys:
                owner[k] = gid
            placed.append((gid, (name, ci), box, ranks, itemsize))
    # group -> (its reads {(name, chunk): (bounding box, itemsize)}, its cells), by first cell
    building: dict[
        int,
        tuple[dict[tuple[str, int], tuple[L.Box, int]], list[tuple[tuple[str, int], L.Box, tuple[int, ...]]]],
    ] = {}
    for gid, key, box, ranks, itemsize in placed:
        reads, cells = building.setdefault(find(gid), ({}, []))
        held = reads.get(key)
        reads[key] = (box if held is None else _bbox(held[0], box), itemsize)
        cells.append((key, box, ranks))
    # readers, in plan order: the rank needing the group with the least work so far (bytes
    # read, sent and received), counting this group's reading and sending
    work = [0] * world
    groups: list[Group] = []
    for gid, (reads, cells) in building.items():
        pos = {k: i for i, k in enumerate(reads)}
        size = sum(b.volume * i for b, i in reads.values())
        sends = 0  # bytes sent if the reader needed nothing
        needed: dict[int, int] = {}  # bytes of the group each rank needs (it is not sent those)
        for k, box, ranks in cells:
            n = box.volume * reads[k][1]
            sends += n * len(ranks)
            for r in ranks:
                needed[r] = needed.get(r, 0) + n
        can = holding.get(gid)
        able = sorted(needed) if can is None else [r for r in sorted(needed) if r in can] or sorted(can)
        if not able:
            raise XckptError(f"internal: read_once found no rank holding {[k[0] for k in reads][:3]}")
        cost = {r: size + sends - needed.get(r, 0) for r in able}
        reader = min(cost, key=lambda r: (work[r] + cost[r], r))
        work[reader] += cost[reader]
        for r, n in needed.items():
            if r != reader:
                work[r] += n
        groups.append(
            Group(
                reader,
                tuple((k[0], b, i) for k, (b, i) in reads.items()),
                tuple(Cell(k[0], box, reads[k][1], ranks, pos[k]) for k, box, ranks in cells),
            )
        )
    # rounds: groups in order while every rank's bytes fit
    rounds: list[tuple[Group, ...]] = []
    cur: list[Group] = []
    load = [0] * world
    for g in groups:
        add = [0] * world
        add[g.reader] += g.read_bytes()
        for c in g.cells:
            for r in c.ranks:
                if r != g.reader:
                    add[g.reader] += c.nbytes
                    add[r] += c.nbytes
        if cur and any(a and a + x > round_bytes for a, x in zip(add, load)):
            rounds.append(tuple(cur))
            cur, load = [], [0] * world
        cur.append(g)
        load = [a + x for a, x in zip(add, load)]
    if cur:
        rounds.append(tuple(cur))
    return Plan(tuple(tuple(s) for s in solo), tuple(rounds))


def _meet(a: frozenset[int] | None, b: frozenset[int] | None) -> frozenset[int] | None:
    """The ranks in both holder sets (None: every rank)."""
    return b if a is None else a if b is None else a & b


def _layout(cells: Sequence[Cell]) -> tuple[list[int], int]:
    """Offsets of ``cells`` packed in one message (aligned), and its length."""
    offs, pos = [], 0
    for c in cells:
        pos = -(-pos // ALIGN) * ALIGN
        offs.append(pos)
        pos += c.nbytes
    return offs, pos


def messages(rnd: Sequence[Group], me: int) -> tuple[dict[int, list[Cell]], dict[int, list[Cell]]]:
    """Cells ``me`` sends to each rank and receives from each rank in round ``rnd``, in
    plan order (both sides lay a message out alike from this)."""
    sends: dict[int, list[Cell]] = {}
    recvs: dict[int, list[Cell]] = {}
    for g in rnd:
        for c in g.cells:
            if g.reader == me:
                for r in c.ranks:
                    if r != me:
                        sends.setdefault(r, []).append(c)
            elif me in c.ranks:
                recvs.setdefault(g.reader, []).append(c)
    return sends, recvs


# -- encoding (int64 arrays, no pickle) --------------------------------------------------------


def fingerprint(ckpt: Source) -> int:
    """What every rank must agree on to read each other's requests: the checkpoint's
    tensor names (their order indexes the requests), dtypes, shapes and save id."""
    text = "\n".join(f"{n}\0{ckpt.info(n).dtype}\0{ckpt.info(n).shape}" for n in ckpt.names())
    return zlib.crc32(f"{ckpt.save_id}\n{text}".encode())


def _encode_needs(needs: Sequence[Need], index: Mapping[str, int], print_: int) -> bytes:
    out = [print_, len(needs)]
    for n in needs:
        out += [index[n.name], n.box.ndim, *n.box.offset, *n.box.shape]
    return b"N" + np.asarray(out, dtype="<i8").tobytes()


def _decode_needs(data: bytes, names: Sequence[str], rank: int, where: str) -> list[Need]:
    try:
        a = np.frombuffer(data[1:], dtype="<i8").tolist()
        count, pos, out = a[1], 2, []
        for _ in range(count):
            i, nd = a[pos], a[pos + 1]
            off, shape = a[pos + 2 : pos + 2 + nd], a[pos + 2 + nd : pos + 2 + 2 * nd]
            if len(shape) != nd:
                raise ValueError("truncated")
            out.append(Need(names[i], L.Box(tuple(off), tuple(shape))))
            pos += 2 + 2 * nd
        if pos != len(a):
            raise ValueError("trailing data")
    except (ValueError, IndexError) as e:
        raise XckptError(
            f"{where}: the requests rank {rank} sent cannot be decoded ({e}); every rank must load the "
            "same checkpoint with the same xckpt version"
        ) from None
    return out


# -- the group's collectives --------------------------------------------------------------------


class _Comm:
    """The collectives of one read_once load, each waited for with ``TIMEOUT_S``."""

    def __init__(self, group: Any, rank: int, world: int, where: str) -> None:
        dist = distributed()
        if dist is None:
            raise XckptError("internal: read_once needs an initialised process group")
        self.dist, self.group, self.rank, self.world, self.where = dist, group, rank, world, where
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=TIMEOUT_S)

    def _global(self, r: int) -> int:
        return r if self.group is None else int(self.dist.get_global_rank(self.group, r))

    def _wait(self, works: Sequence[Any], what: str) -> None:
        for w in works:
            try:
                w.wait(timeout=self.timeout)
            except RuntimeError as e:
                raise XckptError(
                    f"{self.where}: loading with read_once, rank {self.rank} got no {what} within "
                    f"{TIMEOUT_S:g} s ({type(e).__name__}: {e}): another rank stopped (it failed outside "
                    "xckpt.torch.load, was killed, or did not call load with read_once=True); see "
                    "the other ranks' logs"
                ) from e

    def gather_ints(self, value: int, what: str) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._wait([self.dist.all_gather(out, mine, group=self.group, async_op=True)], what)
        return [int(t.item()) for t in out]

    def gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        sizes = self.gather_ints(len(payload), what)
        n = max(sizes)
        out = [torch.empty(n, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        mine = torch.zeros(n, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._wait([self.dist.all_gather(out, mine.to(self.device), group=self.group, async_op=True)], what)
        return [bytes(t[:s].cpu().numpy().tobytes()) for t, s in zip(out, sizes)]

    def share(self, err: BaseException | None, what: str) -> None:
        """Every rank returns, or every rank raises (this rank's own error where it failed)."""
        flags = self.gather_ints(0 if err is None else 1, f"the outcome of {what}")
        if not any(flags):
            return
        msg = b"" if err is None else f"{type(err).__name__}: {err}".encode()
        msgs = self.gather_bytes(msg, f"the errors of {what}")
        if err is not None:
            raise err
        raise_for_ranks(
            [m.decode(errors="replace") if f else None for f, m in zip(flags, msgs)],
            XckptError,
            f"{self.where}: loading with read_once ({what})",
            "Every rank stopped; fix the failing rank's problem and load again",
        )

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, int]],
        what: str,
        pin: bool,
    ) -> dict[int, torch.Tensor]:
        """Send each ``(rank, buffer)``; receive ``(rank, nbytes)``; the received buffers (CPU,
        pinned when ``pin`` and they arrive in host memory)."""
        dist = self.dist
        ops, got = [], {}
        on_host = self.device.type == "cpu"
        for src, n in recvs:
            buf = got[src] = torch.empty(n, dtype=torch.uint8, device=self.device, pin_memory=pin and on_host)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(src), self.group))
        for dst, buf in sends:
            ops.append(dist.P2POp(dist.isend, buf.to(self.device), self._global(dst), self.group))
        if ops:
            self._wait(dist.batch_isend_irecv(ops), what)
        return got if on_host else {r: b.to("cpu") for r, b in got.items()}


# -- one rank's side ---------------------------------------------------------------------------


class _Targets:
    """This rank's target parts by tensor name, and the copies into them (numpy copies
    into CPU memory, the copier for torch tensors elsewhere)."""

    def __init__(self, targets: Sequence[Target], copier: Copier, dtypes: Mapping[str, torch.dtype]) -> None:
        self.by_name: dict[str, list[tuple[L.Box, Any]]] = {}
        self.exact: dict[tuple[str, L.Box], Any] = {}  # whole parts (many small tensors): no search
        for name, box, out in targets:
            self.by_name.setdefault(name, []).append((box, out))
            self.exact[(name, box)] = out
        self.copier = copier
        self.dtypes = dtypes

    def part(self, name: str, box: L.Box) -> Any:
        """The view of this rank's target where ``box`` of ``name`` goes."""
        out = self.exact.get((name, box))
        if out is not None:
            return out
        for tbox, whole in self.by_name.get(name, ()):
            if tbox.contains(box):
                return _at(whole, box.slices(tbox))
        raise XckptError(f"internal: read_once has no target for {name!r} {box}")

    def fill(self, name: str, box: L.Box, src: np.ndarray) -> None:
        """Copy ``src`` (a numpy array of host memory) where ``box`` of ``name`` goes."""
        dst = self.part(name, box)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src, casting="no")
        else:
            self.copier.copy(dst, _torch_view(src, self.dtypes[name]))


def _at(out: Any, slices: tuple[slice, ...]) -> Any:
    """``out[slices]`` as a view, also for a 0-d numpy array (whose ``a[()]`` is a scalar)."""
    return out[slices] if slices else out[...]


def _view(buf: np.ndarray, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Bytes ``offset:`` of ``buf`` (uint8) as an array of ``shape`` and ``dtype``."""
    return buf[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def _torch_view(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``a`` as a torch tensor of ``dtype`` sharing its memory (ml_dtypes types included)."""
    if a.dtype.type.__module__.startswith("ml_dtypes"):
        return torch.from_numpy(a.view(np.dtype(f"u{a.dtype.itemsize}"))).view(dtype)
    return torch.from_numpy(a)


def _host(nbytes: int, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A host buffer (pinned when ``pin``) as a uint8 tensor and its numpy view."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return t, t.numpy()


def load_once(
    ckpt: Source,
    targets: Sequence[Target],
    err: BaseException | None,
    *,
    group: Any,
    rank: int,
    world: int,
    ring: DeviceRing,
    show_progress: bool | None = None,
) -> int:
    """This rank's side of a read_once load (see the module); the bytes it read from storage.

    Args:
        ckpt: the checkpoint (opened alike on every rank).
        targets: this rank's target parts; a numpy view is filled with numpy copies, a
            torch tensor through ``ring`` (its copy hook or the device's side stream).
        err: this rank's failure before loading, shared with the others first.
        group, rank, world: the process group, this rank in it, its size.
        ring: the device pipeline for this rank's own (solo) reads.
        show_progress: a progress bar of the bytes this rank's targets received.

    Raises:
        XckptError: on every rank when any rank failed (a failing rank raises its own).
    """
    where = f"checkpoint {str(ckpt.path)!r}"
    comm = _Comm(group, rank, world, where)
    names = ckpt.names()
    payload = b"E" + f"{type(err).__name__}: {err}".encode() if err is not None else b""
    mine_print = fingerprint(ckpt)
    if err is None:
        index = {n: i for i, n in enumerate(names)}
        payload = _encode_needs([Need(n, b) for n, b, _o in targets], index, mine_print)
    msgs = comm.gather_bytes(payload, "every rank's requests")
    failed = [m[1:].decode(errors="replace") if m[:1] == b"E" else None for m in msgs]
    if err is not None:
        raise err
    raise_for_ranks(
        failed, XckptError, f"{where}: loading with read_once", "Every rank stopped before reading"
    )
    prints = [int(np.frombuffer(m[1:9], dtype="<i8")[0]) if len(m) >= 9 else None for m in msgs]
    if len(set(prints)) > 1:
        by: dict[Any, list[int]] = {}
        for r, p in enumerate(prints):
            by.setdefault(p, []).append(r)
        raise XckptError(
            f"{where}: loading with read_once, the ranks opened different checkpoints (tensor names, "
            f"dtypes, shapes or save ids differ): ranks {sorted(by.values())} agree among themselves. "
            "Every rank of the group must load the same checkpoint"
        )
    decoded: dict[bytes, list[Need]] = {}  # replicas send alike: decoded once
    needs = [
        decoded.get(m) or decoded.setdefault(m, _decode_needs(m, names, r, where)) for r, m in enumerate(msgs)
    ]
    plan = make_plan(ckpt.info, ckpt.read_units, needs, holders=getattr(ckpt, "holders", None))
    dtypes = {t: torch_dtype(ckpt.info(t).dtype) for t in {need.name for rn in needs for need in rn}}
    np_dtypes = {t: ckpt.info(t).np_dtype for t in dtypes}
    pin = (
        torch.cuda.is_available()
        and ring.copy is None
        and any(isinstance(o, torch.Tensor) and o.device.type == "cuda" for _n, _b, o in targets)
    )
    copier = Copier(ring.copy)
    mine = _Targets(targets, copier, dtypes)
    fail: BaseException | None = None
    total = sum(b.volume * dtypes[n].itemsize for n, b, _o in targets)
    with progress(total, f"{ckpt.format or 'xckpt'} load (read once)", show_progress) as bar:
        fail = _rounds(ckpt, plan, rank, comm, mine, copier, ring, np_dtypes, pin, bar)
    comm.share(fail, "loading")
    return plan.group_read_bytes(rank) + sum(b.volume * dtypes[n].itemsize for n, b in plan.solo[rank])


def _rounds(
    ckpt: Source,
    plan: Plan,
    rank: int,
    comm: _Comm,
    mine: _Targets,
    copier: Copier,
    ring: DeviceRing,
    dtypes: Mapping[str, np.dtype],
    pin: bool,
    bar: Any,
) -> BaseException | None:
    """This rank's solo reads, then every round (see the module); its failure, if any."""
    fail: BaseException | None = None
    try:
        direct: list[tuple[str, L.Box, np.ndarray]] = []
        staged: list[tuple[str, L.Box, torch.Tensor]] = []
        for name, box in plan.solo[rank]:
            part = mine.part(name, box)
            (direct if isinstance(part, np.ndarray) else staged).append((name, box, part))
        if direct:
            ckpt.read_into(direct, show_progress=False)
        if staged:
            ring.run(ckpt, staged, show_progress=False)
        bar.update(sum(b.volume * dtypes[n].itemsize for n, b in plan.solo[rank]))
    except Exception as e:  # shared with every rank below
        fail = e
    try:
        for k, rnd in enumerate(plan.rounds):
            what = f"round {k + 1} of {len(plan.rounds)}"
            sends_by, recvs_by = messages(rnd, rank)
            out: list[tuple[int, torch.Tensor]] = []
            scratch = None  # kept until the round's device copies out of it completed
            if fail is None:
                try:
                    out, scratch = _read_round(ckpt, rnd, rank, sends_by, mine, dtypes, pin)
                except Exception as e:
                    fail = e
            comm.share(fail, f"reading {what}")
            recvs = [(src, _layout(cells)[1]) for src, cells in recvs_by.items()]
            got = comm.exchange(out, recvs, f"the data of {what}", pin)
            try:
                for src, cells in recvs_by.items():
                    buf = got[src].numpy()
                    for c, off in zip(cells, _layout(cells)[0]):
                        mine.fill(c.name, c.box, _view(buf, off, c.box.shape, dtypes[c.name]))
                wait_all(copier.mark())
                bar.update(sum(c.nbytes for g in rnd for c in g.cells if rank in c.ranks))
            except Exception as e:
                fail = e
                wait_all(copier.mark())
            del scratch
    finally:
        copier.finish()
        wait_all(copier.mark())
    return fail


def _read_round(
    ckpt: Source,
    rnd: Sequence[Group],
    me: int,
    sends_by: Mapping[int, list[Cell]],
    mine: _Targets,
    dtypes: Mapping[str, np.dtype],
    pin: bool,
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """Read this rank's groups of the round and fill its own targets: the buffers to send,
    and the scratch buffer the reads went to (device copies out of it may still run)."""
    groups = [g for g in rnd if g.reader == me]
    reads = [(g, j, name, box) for g in groups for j, (name, box, _i) in enumerate(g.reads)]
    offs, pos = [], 0
    for _g, _j, name, box in reads:
        pos = -(-pos // ALIGN) * ALIGN
        offs.append(pos)
        pos += box.volume * dtypes[name].itemsize
    keep, scratch = _host(pos, pin)
    views = {
        (id(g), j): (box, _view(scratch, off, box.shape, dtypes[name]))
        for (g, j, name, box), off in zip(reads, offs)
    }
    ckpt.read_into([(name, box, views[(id(g), j)][1]) for g, j, name, box in reads], show_progress=False)

    def cell_data(g: Group, c: Cell) -> np.ndarray:
        box, view = views[(id(g), c.read)]
        return view if c.box == box else _at(view, c.box.slices(box))

    owner = {id(c): g for g in groups for c in g.cells}
    for g in groups:
        for c in g.cells:
            if me in c.ranks:
                mine.fill(c.name, c.box, cell_data(g, c))
    out: list[tuple[int, torch.Tensor]] = []
    made: dict[tuple[int, ...], torch.Tensor] = {}
    for dst, cells in sends_by.items():
        key = tuple(id(c) for c in cells)
        buf = made.get(key)
        if buf is None:
            layout, total = _layout(cells)
            buf, raw = _host(total, False)
            made[key] = buf
            for c, off in zip(cells, layout):
                np.copyto(
                    _view(raw, off, c.box.shape, dtypes[c.name]), cell_data(owner[id(c)], c), casting="no"
                )
        out.append((dst, buf))
    return out, keep
