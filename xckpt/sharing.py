"""Read-once planning: who reads each stored range and sends it to whom (pure arithmetic).

When several ranks of a load need the same stored bytes (replicated tensors, data-parallel
replicas of a sharded layout), `xckpt.torch.load(..., read_once=True)` has one rank
read them and send them to the others. The plan ([make_plan][xckpt.sharing.make_plan])
is computed by one rank from every rank's requests, with no framework, and sent to the
others as int64s ([encode_plan][xckpt.sharing.encode_plan]; each keeps its own part,
[decode_plan][xckpt.sharing.decode_plan]):

* per tensor and saved chunk, the part each rank needs (`plan_reads`). A part only one
  rank needs is read by that rank straight into its target (`Plan.solo`);
* parts several ranks need are cut into *cells* along every rank's part bounds and
  along the chunk's zarr grid (the unit storage reads whole), or, without a grid, into
  slabs of at most `MAX_CELL_BYTES`; each cell lies in or out of each rank's part, so
  each rank receives exactly the cells it needs;
* cells that cost the same storage read (the same key of `Source.read_units`: one
  zarr chunk, one packed span) form a *group*, read by one rank in one read per chunk
  (the bounding box of its cells), so no stored unit is read twice;
* each group's reader is one of the ranks that need it, chosen greedily to even out
  the bytes each rank reads, sends and receives; groups are cut, in order, into
  *rounds* of at most `ROUND_BYTES` per rank (host memory stays bounded).

The torch adapter (`xckpt.torch._read_once`) carries the plan out over the process
group; its tests and this module's run without torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt import layout as L
from xckpt.errors import XckptError
from xckpt.manifest import Chunk, TensorEntry

__all__ = [
    "ROUND_BYTES",
    "MAX_CELL_BYTES",
    "Need",
    "Cell",
    "Group",
    "Plan",
    "make_plan",
    "messages",
    "encode_plan",
    "decode_plan",
]

#: Bytes one rank reads, sends and receives in one round at most (a larger group has a round to itself).
ROUND_BYTES = 256 << 20
#: Cells of a chunk without a zarr grid are cut into slabs of at most this many bytes (spreads reads).
MAX_CELL_BYTES = 16 << 20
@dataclass(frozen=True)
class Need:
    """One box of tensor `name` that a rank loads."""

    name: str
    box: L.Box


@dataclass(frozen=True)
class Cell:
    """Box `box` of tensor `name`, needed by `ranks`; it lies in read `read` of its group."""

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
    """Cells that cost one storage read: `reader` reads `reads` (each inside one
    saved chunk) and sends each cell to the other ranks that need it."""

    reader: int
    reads: tuple[tuple[str, L.Box, int], ...]  # (name, box, itemsize)
    cells: tuple[Cell, ...]

    def read_bytes(self) -> int:
        return sum(b.volume * i for _n, b, i in self.reads)


@dataclass(frozen=True)
class Plan:
    """`solo[r]`: the (name, box) rank r reads for itself alone; `rounds`: the groups,
    round by round."""

    solo: tuple[tuple[tuple[str, L.Box], ...], ...]
    rounds: tuple[tuple[Group, ...], ...]

    def group_read_bytes(self, rank: int) -> int:
        """Bytes (as loaded) rank `rank` reads for the groups it reads."""
        return sum(g.read_bytes() for rnd in self.rounds for g in rnd if g.reader == rank)


def _cuts(lo: int, hi: int, step: int, origin: int) -> list[int]:
    """Multiples of `step` from `origin` strictly inside (lo, hi)."""
    first = origin + (-(-(lo + 1 - origin) // step)) * step
    return list(range(first, hi, step))


def _lattice(
    parts: Sequence[tuple[int, L.Box]], chunk: Chunk, itemsize: int, max_cell: int
) -> list[tuple[L.Box, tuple[int, ...]]]:
    """The cells of the parts `(rank, box)` of one chunk and the ranks needing each."""
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
    """The boxes among `parts` (of one chunk) that another rank needs too, or whose
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


#: The parts of each saved chunk the ranks need: (tensor name, chunk index) -> [(rank, box)].
_ByChunk = dict[tuple[str, int], list[tuple[int, L.Box]]]
#: A cell placed in a group: (group id, (name, chunk index), box, ranks needing it, itemsize).
_Placed = tuple[int, tuple[str, int], L.Box, tuple[int, ...], int]
#: A group being built: its reads {(name, chunk): (bounding box, itemsize)}, its cells
#: [((name, chunk), box, ranks)], and the ranks able to read it (None: every rank).
_Building = tuple[
    dict[tuple[str, int], tuple[L.Box, int]],
    list[tuple[tuple[str, int], L.Box, tuple[int, ...]]],
    "frozenset[int] | None",
]


def make_plan(
    entry: Callable[[str], TensorEntry],
    read_units: Callable[[str, Chunk, L.Box, int], Mapping[Hashable, int]],
    needs: Sequence[Sequence[Need]],
    *,
    round_bytes: int = ROUND_BYTES,
    max_cell: int = MAX_CELL_BYTES,
    holders: Callable[[str, int], frozenset[int] | None] | None = None,
) -> Plan:
    """Who reads what and sends it to whom (see the module); the same whichever rank makes it.

    Args:
        entry: a tensor's entry by name (`Source.info`).
        read_units: `Source.read_units`: the storage units a box of a chunk costs.
        needs: per rank, the boxes it loads.
        round_bytes: see `ROUND_BYTES`.
        max_cell: see `MAX_CELL_BYTES`.
        holders: the ranks able to read chunk `i` of tensor `name` (None: every rank; a
            source whose copies live on some ranks only, the checkpoint manager's local
            tiers, says which). A part is read by a rank that needs it and holds it when
            there is one, else by a holder, which sends it.
    """
    world = len(needs)
    solo: list[list[tuple[str, L.Box]]] = [[] for _ in range(world)]
    placed = _UnitGroups()
    for (name, ci), parts in _parts_by_chunk(entry, needs).items():
        hold = None if holders is None else holders(name, ci)
        if all(r == parts[0][0] for r, _b in parts) and (hold is None or parts[0][0] in hold):
            solo[parts[0][0]].extend((name, b) for _r, b in parts)
            continue
        t = entry(name)
        cells = _cells(name, t.chunks[ci], t.np_dtype.itemsize, parts, read_units, max_cell, solo, hold)
        for box, ranks in cells:
            placed.add(read_units, name, ci, t.chunks[ci], box, ranks, t.np_dtype.itemsize, hold)
    groups = _choose_readers(placed.groups(), world)
    return Plan(tuple(tuple(s) for s in solo), _cut_rounds(groups, world, round_bytes))


def _parts_by_chunk(entry: Callable[[str], TensorEntry], needs: Sequence[Sequence[Need]]) -> _ByChunk:
    """The part of each saved chunk each rank needs (`plan_reads` of every need)."""
    by_chunk: _ByChunk = {}
    # replicas send the same requests (load_once decodes them into one list): planned once
    alike: dict[int, tuple[Sequence[Need], list[int]]] = {}
    for r, rank_needs in enumerate(needs):
        alike.setdefault(id(rank_needs), (rank_needs, []))[1].append(r)
    for rank_needs, same in alike.values():
        for need in rank_needs:
            box = need.box
            if box.empty:
                continue
            index = entry(need.name).chunk_index
            i = index.exact(box)  # a load at the saved sharding: one lookup, no read request built
            if i is not None:
                by_chunk.setdefault((need.name, i), []).extend((r, box) for r in same)
                continue
            for req in L.plan_reads(index, box):
                by_chunk.setdefault((need.name, req.chunk), []).extend((r, req.box) for r in same)
    return by_chunk


def _cells(
    name: str,
    chunk: Chunk,
    itemsize: int,
    parts: list[tuple[int, L.Box]],
    read_units: Callable[[str, Chunk, L.Box, int], Mapping[Hashable, int]],
    max_cell: int,
    solo: list[list[tuple[str, L.Box]]],
    hold: frozenset[int] | None,
) -> list[tuple[L.Box, tuple[int, ...]]]:
    """The shared cells of one chunk with the ranks needing each; parts no other rank
    shares, of a rank that holds the chunk, go to `solo` (read by their rank alone)."""
    first = parts[0][1]
    if all(b == first for _r, b in parts) and chunk.grid is None and first.volume * itemsize <= max_cell:
        # replicas of one small stored piece (many small tensors): one cell
        return [(first, tuple(sorted({r for r, _b in parts})))]
    shared = _shared_parts(parts, functools.partial(_units_of, read_units, name, chunk, itemsize))
    for r, b in parts:
        if b not in shared and (hold is None or r in hold):
            solo[r].append((name, b))
    if hold is not None:  # a rank that cannot read the chunk is sent its part
        shared |= {b for r, b in parts if r not in hold}
    parts = [(r, b) for r, b in parts if b in shared]
    return _lattice(parts, chunk, itemsize, max_cell) if parts else []


class _UnitGroups:
    """Cells joined into groups when they cost a storage unit in common (union-find over
    the units: a packed tensor straddling two packed spans joins their groups)."""

    def __init__(self) -> None:
        self.owner: dict[Hashable, int] = {}  # storage unit -> a group id
        self.parent: list[int] = []
        self.placed: list[_Placed] = []
        self.holding: dict[int, frozenset[int] | None] = {}  # group id -> the ranks holding all its chunks

    def find(self, gid: int) -> int:
        parent = self.parent
        while parent[gid] != gid:
            parent[gid] = parent[parent[gid]]
            gid = parent[gid]
        return gid

    def add(
        self,
        read_units: Callable[[str, Chunk, L.Box, int], Mapping[Hashable, int]],
        name: str,
        ci: int,
        chunk: Chunk,
        box: L.Box,
        ranks: tuple[int, ...],
        itemsize: int,
        hold: frozenset[int] | None = None,
    ) -> None:
        keys = list(read_units(name, chunk, box, itemsize)) or [("cell", name, ci, box)]
        roots = sorted({self.find(self.owner[k]) for k in keys if k in self.owner})
        if roots:
            gid = roots[0]
            for other in roots[1:]:
                self.parent[other] = gid
                self.holding[gid] = _meet(self.holding.get(gid), self.holding.pop(other, None))
        else:
            gid = len(self.parent)
            self.parent.append(gid)
        self.holding[gid] = _meet(self.holding.get(gid), hold)
        for k in keys:
            self.owner[k] = gid
        self.placed.append((gid, (name, ci), box, ranks, itemsize))

    def groups(self) -> list[_Building]:
        """Each group's reads `{(name, chunk): (bounding box, itemsize)}`, cells and the ranks
        able to read it (None: every rank), by first cell."""
        building: dict[
            int,
            tuple[dict[tuple[str, int], tuple[L.Box, int]], list[tuple[tuple[str, int], L.Box, tuple[int, ...]]]],
        ] = {}
        for gid, key, box, ranks, itemsize in self.placed:
            reads, cells = building.setdefault(self.find(gid), ({}, []))
            held = reads.get(key)
            reads[key] = (box if held is None else _bbox(held[0], box), itemsize)
            cells.append((key, box, ranks))
        return [(reads, cells, self.holding.get(gid)) for gid, (reads, cells) in building.items()]


def _choose_readers(building: Sequence[_Building], world: int) -> list[Group]:
    """Each group's reader, in plan order: the rank needing the group (among those able to
    read it) with the least work so far (bytes read, sent and received), counting this
    group's reading and sending; a group no rank needing it can read goes to a holder.

    Raises:
        XckptError: no rank can read a group (the holders reported none).
    """
    work = [0] * world
    groups: list[Group] = []
    for reads, cells, can in building:
        pos = {k: i for i, k in enumerate(reads)}
        size = sum(b.volume * i for b, i in reads.values())
        sends = 0  # bytes sent if the reader needed nothing
        needed: dict[int, int] = {}  # bytes of the group each rank needs (it is not sent those)
        for k, box, ranks in cells:
            n = box.volume * reads[k][1]
            sends += n * len(ranks)
            for r in ranks:
                needed[r] = needed.get(r, 0) + n
        able = sorted(needed) if can is None else [r for r in sorted(needed) if r in can] or sorted(can)
        if not able:
            raise XckptError(f"read_once: no rank holds {[k[0] for k in reads][:3]}")
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
    return groups


def _meet(a: frozenset[int] | None, b: frozenset[int] | None) -> frozenset[int] | None:
    """The ranks in both holder sets (None: every rank)."""
    return b if a is None else a if b is None else a & b


def _cut_rounds(groups: Sequence[Group], world: int, round_bytes: int) -> tuple[tuple[Group, ...], ...]:
    """Groups in order, cut into rounds while every rank's bytes fit `round_bytes`."""
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
    return tuple(rounds)


def messages(rnd: Sequence[Group], me: int) -> tuple[dict[int, list[Cell]], dict[int, list[Cell]]]:
    """Cells `me` sends to each rank and receives from each rank in round `rnd`, in
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


# -- the plan on the wire: planned by one rank, sent to the others -------------------------------


def _box_ints(box: L.Box) -> list[int]:
    return [box.ndim, *box.offset, *box.shape]


def encode_plan(plan: Plan, index: Mapping[str, int]) -> bytes:
    """`plan` as little-endian int64s (tensor names as their positions in `index`), for the
    ranks that did not plan it: each rank's solo reads and each group carry their length, and
    each group the ranks it concerns, so [decode_plan][xckpt.sharing.decode_plan] skips what
    is not its rank's without reading it."""
    out = [len(plan.solo)]
    for entries in plan.solo:
        body: list[int] = []
        for name, box in entries:
            body += [index[name], *_box_ints(box)]
        out += [len(body), *body]
    out.append(len(plan.rounds))
    for rnd in plan.rounds:
        out.append(len(rnd))
        for g in rnd:
            who = sorted({g.reader, *(r for c in g.cells for r in c.ranks)})
            body = [g.reader, len(who), *who, len(g.reads)]
            for name, box, itemsize in g.reads:
                body += [index[name], itemsize, *_box_ints(box)]
            body.append(len(g.cells))
            for c in g.cells:
                body += [index[c.name], c.itemsize, c.read, len(c.ranks), *c.ranks, *_box_ints(c.box)]
            out += [len(body), *body]
    return np.asarray(out, dtype="<i8").tobytes()


def decode_plan(data: bytes, names: Sequence[str], me: int) -> Plan:
    """The part of an [encode_plan][xckpt.sharing.encode_plan]d plan that rank `me` carries
    out: its own solo reads (the other ranks' are empty) and, round by round, the groups it
    reads or receives from, in plan order ([messages][xckpt.sharing.messages] of it are the
    full plan's for `me`).

    Raises:
        ValueError: `data` is not an encoded plan (cut short, or its counts disagree).
    """
    if len(data) % 8:
        raise ValueError(f"its length ({len(data)} bytes) is not a whole number of int64s")
    try:
        return _decode(np.frombuffer(data, dtype="<i8").tolist(), names, me)
    except IndexError:
        raise ValueError("it is cut short") from None


def _decode(a: list[int], names: Sequence[str], me: int) -> Plan:
    end = len(a)

    def count(p: int) -> int:
        """A count or length at `p`: never negative, never past the end (every position only
        moves forward, and no loop runs longer than the data)."""
        n = a[p]
        if not 0 <= n <= end - p:
            raise ValueError(f"a count ({n}) at int64 {p} does not fit in its {end} int64s")
        return n

    def name(i: int) -> str:
        if not 0 <= i < len(names):
            raise ValueError(f"tensor {i} is not one of the checkpoint's {len(names)}")
        return names[i]

    def box(p: int) -> tuple[L.Box, int]:
        nd = count(p)
        q = p + 1 + 2 * nd
        if q > end or min(a[p + 1 : q], default=0) < 0:
            raise ValueError("a box is cut short or negative")
        return L.Box.trusted(tuple(a[p + 1 : p + 1 + nd]), tuple(a[p + 1 + nd : q])), q

    world, p = count(0), 1
    solo: list[tuple[tuple[str, L.Box], ...]] = [()] * world
    for r in range(world):
        n, p = count(p), p + 1
        if r == me:
            mine, q = [], p
            while q < p + n:
                b, q2 = box(q + 1)
                mine.append((name(a[q]), b))
                q = q2
            if q != p + n:
                raise ValueError(f"rank {r}'s solo reads run past their length")
            solo[r] = tuple(mine)
        p += n
    rounds: list[tuple[Group, ...]] = []
    nrounds, p = count(p), p + 1
    for _k in range(nrounds):
        ngroups, p = count(p), p + 1
        kept: list[Group] = []
        for _g in range(ngroups):
            n, p = count(p), p + 1
            stop = p + n
            reader, nwho = a[p], count(p + 1)
            if reader == me or me in a[p + 2 : p + 2 + nwho]:
                kept.append(_decode_group(a, p + 2 + nwho, stop, count, name, reader, box))
            p = stop
        rounds.append(tuple(kept))
    if p != end:
        raise ValueError("its counts disagree with its length")
    return Plan(tuple(solo), tuple(rounds))


def _decode_group(
    a: list[int],
    p: int,
    stop: int,
    count: Callable[[int], int],
    name: Callable[[int], str],
    reader: int,
    box: Callable[[int], tuple[L.Box, int]],
) -> Group:
    reads = []
    nreads, p = count(p), p + 1
    for _i in range(nreads):
        n, itemsize = name(a[p]), a[p + 1]
        b, p = box(p + 2)
        reads.append((n, b, itemsize))
    cells = []
    ncells, p = count(p), p + 1
    for _i in range(ncells):
        n, itemsize, read, nr = name(a[p]), a[p + 1], a[p + 2], count(p + 3)
        ranks = tuple(a[p + 4 : p + 4 + nr])
        b, p = box(p + 4 + nr)
        if not 0 <= read < nreads:
            raise ValueError(f"a cell lies in read {read} of a group of {nreads}")
        cells.append(Cell(n, b, itemsize, ranks, read))
    if p != stop:
        raise ValueError("a group's parts disagree with its length")
    return Group(reader, tuple(reads), tuple(cells))
