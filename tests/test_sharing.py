"""Read-once planning (`xckpt.sharing`), with no framework: on synthetic layouts against a
simple model, every element of every rank's request arrives exactly once, every zarr chunk
is read by one rank, rounds keep to their budget; and the planner runs where torch cannot
be imported.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xckpt import layout as L
from xckpt.manifest import Chunk, TensorEntry
from xckpt.sharing import Need, decode_plan, encode_plan, make_plan, messages

# -- the plan, on synthetic layouts -------------------------------------------------------------


def _entry(shape, writers, grid, itemsize=4):
    """A tensor saved as ``writers`` (boxes), each stored with zarr chunks of ``grid`` rows."""
    chunks = tuple(
        Chunk(
            offset=b.offset,
            shape=b.shape,
            key=f"k{i}",
            rank=i,
            nbytes=b.volume * itemsize,
            grid=(grid,) + b.shape[1:],
        )
        for i, b in enumerate(writers)
    )
    return TensorEntry(name="t", dtype=f"uint{8 * itemsize}", shape=shape, chunks=chunks)


def _units(name, chunk, box, itemsize):
    """The model of storage: a zarr chunk (rows of ``grid``) is read whole."""
    g = chunk.grid[0]
    lo, hi = box.offset[0] - chunk.offset[0], box.end[0] - chunk.offset[0]
    return {(chunk.key, i): g * itemsize for i in range(lo // g, (hi - 1) // g + 1)}


def _rows(shape, n, k):
    """Rows of shard k of n (torch's chunk rule)."""
    cs = -(-shape[0] // n)
    lo = min(shape[0], cs * k)
    return lo, max(0, min(shape[0], cs * (k + 1)) - lo)


def _layout(kind, shape, world, rank):
    """The boxes rank ``rank`` loads of a tensor of ``shape``."""
    full = L.Box.full(shape)
    if kind == "replicated":
        return [full]
    if kind == "rows":  # Shard(0) over every rank
        lo, n = _rows(shape, world, rank)
        return [L.Box((lo, 0), (n, shape[1]))] if n else []
    if kind == "dp_tp_rows":  # (dp, tp) = (world // 2, 2): Replicate, Shard(0)
        lo, n = _rows(shape, 2, rank % 2)
        return [L.Box((lo, 0), (n, shape[1]))] if n else []
    if kind == "dp_tp_cols":  # Replicate, Shard(1)
        lo, n = _rows(shape[::-1], 2, rank % 2)
        return [L.Box((0, lo), (shape[0], n))] if n else []
    if kind == "half":  # rank 0 the whole tensor, the others their rows
        return [full] if rank == 0 else _layout("rows", shape, world, rank)
    raise AssertionError(kind)


PLANS = [
    (kind, writers, world, grid, budget)
    for kind in ("replicated", "rows", "dp_tp_rows", "dp_tp_cols", "half")
    for writers, world, grid, budget in (
        (1, 4, 16, 1 << 30),
        (3, 4, 5, 1 << 30),
        (2, 2, 7, 4000),
        (1, 3, 64, 1 << 30),
    )
]


@pytest.mark.parametrize(
    "kind,writers,world,grid,budget", PLANS, ids=[f"{k}-w{w}-n{n}-g{g}-b{b}" for k, w, n, g, b in PLANS]
)
def test_plan_delivers_every_element_once_and_reads_each_stored_chunk_once(
    kind, writers, world, grid, budget
):
    shape = (100, 24)
    wboxes = [L.Box((lo, 0), (n, 24)) for lo, n in (_rows(shape, writers, k) for k in range(writers)) if n]
    entries = {"t": _entry(shape, wboxes, grid)}
    needs = [[Need("t", b) for b in _layout(kind, shape, world, r)] for r in range(world)]
    plan = make_plan(entries.__getitem__, _units, needs, round_bytes=budget)
    got = [np.zeros(shape, dtype=int) for _ in range(world)]
    reads: dict = {}
    for r in range(world):
        for name, box in plan.solo[r]:
            got[r][box.slices()] += 1
            for c in entries[name].chunks:
                common = c.box.intersect(box)
                if common is not None:
                    for u in _units(name, c, common, 4):
                        reads.setdefault(u, set()).add(r)
    for rnd in plan.rounds:
        load = [0] * world
        for g in rnd:
            for name, box, _i in g.reads:
                (c,) = [c for c in entries[name].chunks if c.box.contains(box)]  # inside one chunk
                for u in _units(name, c, box, 4):
                    reads.setdefault(u, set()).add(g.reader)
                load[g.reader] += box.volume * 4
            for cell in g.cells:
                assert g.reader in range(world) and set(cell.ranks) <= set(range(world))
                assert g.reads[cell.read][1].contains(cell.box)
                for r in cell.ranks:
                    got[r][cell.box.slices()] += 1
                    if r != g.reader:
                        load[r] += cell.nbytes
                        load[g.reader] += cell.nbytes
        assert len(rnd) == 1 or max(load) <= budget
    for r in range(world):
        want = np.zeros(shape, dtype=int)
        for need in needs[r]:
            want[need.box.slices()] += 1
        assert (got[r] == want).all(), f"rank {r} gets {got[r]} != {want}"
    # every stored zarr chunk is read by one rank
    assert all(len(rs) == 1 for rs in reads.values()), {u: rs for u, rs in reads.items() if len(rs) > 1}
    # both sides of every message agree
    for rnd in plan.rounds:
        for r in range(world):
            sends, _ = messages(rnd, r)
            for dst, cells in sends.items():
                assert messages(rnd, dst)[1][r] == cells
    _check_wire(plan, world)


def _check_wire(plan, world, names=("t",)):
    """Each rank's part of the plan, sent by the planner, carries out the same plan for it."""
    blob = encode_plan(plan, {n: i for i, n in enumerate(names)})
    for r in range(world):
        mine = decode_plan(blob, list(names), r)
        assert mine.solo[r] == plan.solo[r] and all(s == () for k, s in enumerate(mine.solo) if k != r)
        assert len(mine.rounds) == len(plan.rounds)
        for full, part in zip(plan.rounds, mine.rounds):
            assert messages(part, r) == messages(full, r)
            assert [g for g in full if g in part] == list(part)  # plan order kept
            assert all(g in part for g in full if g.reader == r or any(r in c.ranks for c in g.cells))
        assert mine.group_read_bytes(r) == plan.group_read_bytes(r)


def test_plan_spreads_a_replicated_tensor_over_the_readers():
    shape = (160, 16)
    entries = {"t": _entry(shape, [L.Box.full(shape)], 10)}  # 16 zarr chunks
    needs = [[Need("t", L.Box.full(shape))] for _ in range(4)]
    plan = make_plan(entries.__getitem__, _units, needs)
    per = [plan.group_read_bytes(r) for r in range(4)]
    assert per == [shape[0] * shape[1] * 4 // 4] * 4
    assert plan.solo == ((), (), (), ())


def test_plan_keeps_unshared_parts_local():
    shape = (100, 24)
    entries = {"t": _entry(shape, [L.Box.full(shape)], 25)}  # zarr chunks of 25 rows
    needs = [[Need("t", b) for b in _layout("rows", shape, 4, r)] for r in range(4)]
    plan = make_plan(entries.__getitem__, _units, needs)
    assert plan.rounds == ()
    assert [list(s) for s in plan.solo] == [[("t", n.box)] for rn in needs for n in rn]




def test_plan_reads_only_from_holders():
    """With ``holders`` (the manager's local tiers: node A's ranks 0, 1 hold every part, a
    replaced node B holds none): a part is read by a rank that needs it and holds it, else
    by a holder, which sends it; the holders share the work."""
    shape = (100, 24)
    writers = [L.Box((25 * k, 0), (25, 24)) for k in range(4)]
    entries = {"t": _entry(shape, writers, 25)}
    needs = [[Need("t", b) for b in _layout("rows", shape, 4, r)] for r in range(4)]
    plan = make_plan(entries.__getitem__, _units, needs, holders=lambda name, i: frozenset({0, 1}))
    assert plan.solo == ((("t", writers[0]),), (("t", writers[1]),), (), ())
    cells = {c.box: (g.reader, c.ranks) for rnd in plan.rounds for g in rnd for c in g.cells}
    assert cells == {writers[2]: (0, (2,)), writers[3]: (1, (3,))}


def _a_plan():
    shape = (100, 24)
    entries = {"t": _entry(shape, [L.Box.full(shape)], 10)}
    needs = [[Need("t", b) for b in _layout("half", shape, 3, r)] for r in range(3)]
    return make_plan(entries.__getitem__, _units, needs)


def test_a_plan_on_the_wire_with_holders_and_many_tensors():
    writers = [L.Box((25 * k, 0), (25, 24)) for k in range(4)]
    entries = {n: _entry((100, 24), writers, 25) for n in ("a", "b", "c")}
    needs = [[Need(n, b) for n in entries for b in _layout("rows", (100, 24), 4, r)] for r in range(4)]
    plan = make_plan(entries.__getitem__, _units, needs, holders=lambda name, i: frozenset({0, 1}))
    assert plan.rounds and all(plan.solo[:2])
    _check_wire(plan, 4, names=("c", "a", "b"))


@pytest.mark.parametrize(
    "cut,message",
    [
        (lambda b: b[:-8], "counts disagree with its length"),
        (lambda b: b[:16], r"a count \(3\) at int64 0 does not fit in its 2 int64s"),
        (lambda b: b + bytes(8), "counts disagree with its length"),
        (lambda b: b[:-3], "not a whole number of int64s"),
        (lambda b: (2**40).to_bytes(8, "little") + b[8:], r"a count \(1099511627776\) at int64 0 does not fit"),
    ],
)
def test_a_damaged_plan_is_refused(cut, message):
    blob = encode_plan(_a_plan(), {"t": 0})
    with pytest.raises(ValueError, match=message):
        decode_plan(cut(blob), ["t"], 1)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decoding_any_damaged_plan_raises_value_error_or_gives_a_plan(data):
    blob = bytearray(encode_plan(_a_plan(), {"t": 0}))
    words = len(blob) // 8
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, words - 1))
        value = data.draw(st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1)))
        blob[8 * at : 8 * at + 8] = value.to_bytes(8, "little", signed=True)
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    try:
        plan = decode_plan(bytes(blob), ["t"], data.draw(st.integers(0, 2)))
    except ValueError:
        return
    for rnd in plan.rounds:
        for g in rnd:
            for c in g.cells:
                assert c.name == "t" and 0 <= c.read < len(g.reads)


def test_the_planner_runs_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from xckpt import layout as L\n"
        "from xckpt.sharing import make_plan, Need\n"
        "from xckpt.manifest import Chunk\n"
        "from xckpt.manifest import TensorEntry\n"
        "c = Chunk(offset=(0, 0), shape=(8, 4), key='k', rank=0, nbytes=128, grid=(2, 4))\n"
        "e = TensorEntry(name='t', dtype='uint32', shape=(8, 4), chunks=(c,))\n"
        "units = lambda n, ch, b, i: {(ch.key, r // 2): 32 for r in range(b.offset[0], b.end[0])}\n"
        "plan = make_plan(lambda n: e, units, [[Need('t', L.Box.full((8, 4)))]] * 2)\n"
        "assert sum(len(r) for r in plan.rounds) == 4, plan\n"
        "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
