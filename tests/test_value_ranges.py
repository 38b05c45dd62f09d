"""Value groups: the pure arithmetic, the worked example, the read path and its checks.

Ranks are simulated in one process here (one Writer per rank, then ``finalize``;
``load_value_groups`` per new rank with no process group); the spawned gloo
tests are in test_value_groups_dist.py, real torchrec in test_value_torchrec.py.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from test_value_helpers import (
    COUNTS,
    ITER,
    MOM,
    PREFIX,
    RAW,
    ROWS,
    SEG,
    WEIGHT,
    check_lookups,
    empty_target,
    id_table,
    make_rank_state,
    named,
)

import xckpt
from xckpt.errors import ShapeMismatchError, ValueRangeError
from xckpt.torch.value_groups import (
    ManagedCollision,
    ValueGroup,
    load_value_groups,
    save_value_groups,
    split_value_groups,
)
from xckpt.values.load import read_group_rank
from xckpt.values.ranges import (
    INT64_MAX,
    GroupAnnotation,
    MCLayout,
    Members,
    assemble_rank,
    ceil_bounds,
    check_keys,
    group_annotations,
    plan_rank_read,
    position_equivalent,
    position_rank,
    row_runs,
    value_chunks,
)
from xckpt.values.save import LocalRows, plan_mc_save

M = INT64_MAX


def _decl(input_size: int, chunk_rows: int = 1 << 19) -> ManagedCollision:
    return ManagedCollision(PREFIX, weight=WEIGHT, input_size=input_size, row_aligned=[MOM], chunk_rows=chunk_rows)


def save_sim(path: str, states: list[dict[str, np.ndarray]], decls: list, save_id: str = "s1") -> None:
    """Save ``states`` (rank r's named arrays) as W simulated ranks."""
    world = len(states)
    for r, st in enumerate(states):
        w = xckpt.Writer(path, rank=r, world_size=world, save_id=save_id)
        flat = {k: torch.from_numpy(v.copy()) for k, v in st.items()}
        plans, owned = split_value_groups(flat, decls)
        save_value_groups(w, flat, plans, r, world)
        for k, v in flat.items():
            if k not in owned:
                w.write(k, v.numpy())
        w.commit()
    xckpt.finalize(path, world, save_id)


def load_sim(path: str, n_rows: int, world: int, strict: bool = False) -> tuple[list[dict], list[dict]]:
    """Load into ``world`` fresh simulated ranks; -> (loaded arrays, evicted per rank)."""
    ckpt = xckpt.open(path)
    out, ev = [], []
    for r in range(world):
        tgt = {k: torch.from_numpy(v) for k, v in empty_target(n_rows, world, r).items()}
        handled, evicted = load_value_groups(ckpt, tgt, r, world, None, strict)
        assert handled == set(tgt)
        out.append({k: v.numpy() for k, v in tgt.items()})
        ev.append(evicted)
    return out, ev


# -- arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "w", "sizes"), [(10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0]), (16, 3, [6, 6, 4]), (8, 1, [8])]
)
def test_ceil_bounds_match_torchrec(n: int, w: int, sizes: list[int]) -> None:
    b = ceil_bounds(n, w)
    assert [b[i + 1] - b[i] for i in range(w)] == sizes


def test_owner_of_default_input_size() -> None:
    lay = MCLayout(M, ceil_bounds(12, 3))
    block = -(-M // 3)
    x = np.array([0, block - 1, block, 2 * block, M - 1], np.int64)
    assert lay.owner(x).tolist() == [0, 0, 1, 2, 2]


@pytest.mark.parametrize(
    ("n", "i", "w", "w2", "expect"),
    [(8, 16, 2, 1, True), (16, 2**62, 4, 2, True), (8, 10, 4, 2, False), (12, 12, 4, 3, False),
     (8, 16, 2, 4, False), (16, M, 4, 2, True), (18, M, 6, 3, False)],
)
def test_position_equivalent(n: int, i: int, w: int, w2: int, expect: bool) -> None:
    assert position_equivalent(MCLayout(i, ceil_bounds(n, w)), MCLayout(i, ceil_bounds(n, w2))) is expect


def test_value_chunks_tile_the_rank_range() -> None:
    keys = np.array([3, 5, 8, 9, 11, M, M], np.int64)
    assert value_chunks(keys, 0, 16, 2) == [(0, 2, (0, 8)), (2, 4, (8, 11)), (4, 5, (11, 16)), (5, 7, None)]


def test_row_runs_merge_small_gaps() -> None:
    assert row_runs(np.array([9, 1, 2, 3, 40]), box_cost=0) == [(1, 4), (9, 10), (40, 41)]
    assert row_runs(np.array([9, 1, 2, 3, 40]), box_cost=0, max_runs=2) == [(1, 10), (40, 41)]
    assert row_runs(np.array([1, 2, 3, 5, 7, 20]), box_cost=0, max_runs=2) == [(1, 8), (20, 21)]
    assert row_runs(np.array([5, 7]), max_runs=1) == [(5, 8)]


@pytest.mark.parametrize(("box_cost", "runs"), [(25, [(0, 2), (5, 6), (100, 101)]), (40, [(0, 6), (100, 101)]),
                                                 (10_000, [(0, 101)])])
def test_row_runs_take_the_cheapest_split(box_cost: int, runs: list) -> None:
    assert row_runs(np.array([0, 1, 5, 100]), row_bytes=10, box_cost=box_cost) == runs


# -- the worked example of DESIGN section 4 -----------------------------------------

SAVED = [
    (np.array([2, 5, 7, M]), np.array([1, 0, 2, 3]), np.array([4, 9, 1, 0])),
    (np.array([9, 12, M, M]), np.array([6, 4, 5, 7]), np.array([3, 2, 0, 0])),
]


def _worked(world: int) -> list:
    raw = np.concatenate([s[0] for s in SAVED])
    rows = np.concatenate([s[1] for s in SAVED])
    cnt = np.concatenate([s[2] for s in SAVED])
    used = raw != M
    lay = MCLayout(16, ceil_bounds(8, world))
    own = lay.owner(raw[used])
    return [
        assemble_rank(raw[used][own == r], rows[used][own == r], {"c": cnt[used][own == r]}, lay, r, ["c"])
        for r in range(world)
    ]


def test_worked_example_to_4_ranks() -> None:
    got = _worked(4)
    assert [a.raw.tolist() for a in got] == [[2, M], [5, M], [9, M], [12, M]]
    assert [a.rows.tolist() for a in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [a.meta["c"].tolist() for a in got] == [[4, 0], [9, 0], [3, 0], [2, 0]]
    assert [a.evicted for a in got] == [0, 1, 0, 0]  # 7 (count 1) loses to 5 (count 9)
    # weight rows: new0 <- old1, new2 <- old0, new4 <- old6, new6 <- old4; the rest by position
    assert np.concatenate([a.source_rows for a in got]).tolist() == [1, 1, 0, 3, 6, 5, 4, 7]


def test_worked_example_to_1_rank() -> None:
    (a,) = _worked(1)
    assert a.raw.tolist() == [2, 5, 7, 9, 12, M, M, M]
    assert a.rows.tolist() == [1, 0, 2, 6, 4, 3, 5, 7]
    assert a.meta["c"].tolist() == [4, 9, 1, 3, 2, 0, 0, 0]
    assert a.source_rows.tolist() == list(range(8))  # no row moves


def test_worked_example_position_path_agrees_at_1_rank() -> None:
    raw = np.concatenate([s[0] for s in SAVED])
    rows = np.concatenate([s[1] for s in SAVED])
    cnt = np.concatenate([s[2] for s in SAVED])
    p = position_rank(raw, rows, {"c": cnt}, MCLayout(16, (0, 8)), 0)
    (a,) = _worked(1)
    assert p.raw.tolist() == a.raw.tolist() and p.rows.tolist() == a.rows.tolist()
    assert p.meta["c"].tolist() == a.meta["c"].tolist()


def test_routing_by_row_alone_loses_lookups() -> None:
    """The positional fix (owner = row // rows_per_rank) sends 5, 9, 12 to ranks that never see them."""
    raw, rows = np.array([2, 5, 7, 9, 12]), np.array([1, 0, 2, 6, 4])
    by_row = rows // 2
    by_input = MCLayout(16, ceil_bounds(8, 4)).owner(raw)
    assert by_row.tolist() == [0, 0, 1, 3, 2]
    assert by_input.tolist() == [0, 1, 1, 2, 3]


# -- eviction, checks -----------------------------------------------------------------


def test_overflow_keeps_highest_counts() -> None:
    lay = MCLayout(100, (0, 4))  # 3 usable rows
    a = assemble_rank(np.array([1, 2, 3, 4, 5]), np.array([0, 1, 2, 9, 8]),
                      {"c": np.array([5, 50, 1, 40, 30])}, lay, 0, ["c"])
    assert a.evicted == 2
    assert a.raw[:3].tolist() == [2, 4, 5] and a.meta["c"][:3].tolist() == [50, 40, 30]
    assert a.rows.tolist() == [1, 0, 2, 3]  # 2 keeps row 1; 4, 5 re-slotted to 0, 2; miss row 3 last


def test_overflow_strict_raises() -> None:
    with pytest.raises(ValueRangeError, match="owns 5 ids but has room for 3"):
        assemble_rank(np.arange(5), np.arange(5), {}, MCLayout(100, (0, 4)), 0, strict_capacity=True)


@pytest.mark.parametrize(
    ("raw", "rows", "msg"),
    [([1, 1], [0, 1], "raw id 1 appears twice"), ([1, 2], [0, 0], "row 0 is mapped by two raw ids"),
     ([1, 200], [0, 1], r"outside \[0, 100\)")],
)
def test_assemble_rejects_bad_entries(raw: list, rows: list, msg: str) -> None:
    with pytest.raises(ValueRangeError, match=msg):
        assemble_rank(np.array(raw), np.array(rows), {}, MCLayout(100, (0, 8)), 0, name="t")


@pytest.mark.parametrize(
    ("keys", "vr", "msg"),
    [([1, 20, M], (0, 10), "key 20 outside its chunk's range"), ([3, 3], (0, 10), "key 3 twice"),
     ([3, M], None, "no value range holding 1 used keys")],
)
def test_check_keys_errors(keys: list, vr: tuple | None, msg: str) -> None:
    with pytest.raises(ValueRangeError, match=msg):
        check_keys(np.array(keys, np.int64), vr, "k", "ckpt")


# -- through a checkpoint (simulated ranks) ----------------------------------------------

N, I_SMALL = 48, 10_000


@pytest.mark.parametrize(("w", "w2"), [(2, 3), (4, 3), (3, 2), (1, 4)])
def test_simulated_reshard_keeps_every_lookup(tmp_path: os.PathLike, w: int, w2: int) -> None:
    states = [make_rank_state(N, w, r, I_SMALL, seed=w) for r in range(w)]
    table = id_table(states, ceil_bounds(N, w))
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL, chunk_rows=5)])
    loaded, ev = load_sim(str(tmp_path), N, w2)
    missing = check_lookups(table, loaded, I_SMALL, N)
    assert missing == sum(e[PREFIX] for e in ev) == 0
    assert all(int(st[ITER][0]) == 7 + w - 1 for st in loaded)  # max over saved ranks


@pytest.mark.parametrize("prefix", [PREFIX, PREFIX + "."], ids=["bare", "trailing-dot"])
def test_managed_collision_prefix_with_or_without_trailing_dot(tmp_path: os.PathLike, prefix: str) -> None:
    decl = ManagedCollision(prefix, weight=WEIGHT, input_size=I_SMALL, row_aligned=[MOM], chunk_rows=5)
    assert decl.prefix == PREFIX  # stored without the dot torch prints in state-dict keys
    states = [make_rank_state(N, 2, r, I_SMALL, seed=5) for r in range(2)]
    table = id_table(states, ceil_bounds(N, 2))
    save_sim(str(tmp_path), [named(s) for s in states], [decl])
    assert xckpt.open(str(tmp_path)).info(RAW).value_range.group == PREFIX
    loaded, ev = load_sim(str(tmp_path), N, 3)
    assert check_lookups(table, loaded, I_SMALL, N) == sum(e[PREFIX] for e in ev) == 0


def test_overflow_through_checkpoint_reports_evictions(tmp_path: os.PathLike) -> None:
    # Rank 1 of 2 is nearly full; at 4 ranks its input block splits unevenly, so some owner overflows.
    states = [make_rank_state(N, 2, r, I_SMALL, fill=1.0, seed=3) for r in range(2)]
    table = id_table(states, ceil_bounds(N, 2))
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL)])
    with pytest.warns(UserWarning, match="evicted"):
        loaded, ev = load_sim(str(tmp_path), N, 4)
    total = sum(e[PREFIX] for e in ev)
    assert total > 0 and check_lookups(table, loaded, I_SMALL, N) == total
    # the kept ids on an overflowing rank are the highest by count
    lay = MCLayout(I_SMALL, ceil_bounds(N, 4))
    for r, st in enumerate(loaded):
        if ev[r][PREFIX]:
            owned = [x for x in table if lay.owner(np.array([x]))[0] == r]
            kept = set(st[RAW][st[RAW] != M].tolist())
            low = min(table[x][2] for x in kept)
            assert all(table[x][2] <= low for x in owned if x not in kept)
    with pytest.raises(ValueRangeError, match="strict_capacity=False"):
        load_sim(str(tmp_path), N, 4, strict=True)


@pytest.mark.parametrize(("w", "w2"), [(4, 2), (2, 1), (4, 1)])
def test_divisible_position_path_equals_value_path(tmp_path: os.PathLike, w: int, w2: int) -> None:
    n, size = 64, 2**40
    states = [make_rank_state(n, w, r, size, seed=11) for r in range(w)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(size, chunk_rows=4)])
    ckpt = xckpt.open(str(tmp_path))
    for r in range(w2):
        pos = read_group_rank(ckpt, RAW, r, w2)
        val = read_group_rank(ckpt, RAW, r, w2, force_path="value")
        assert (pos.path, val.path) == ("position", "value")
        assert pos.arrays.keys() == val.arrays.keys()
        for k in pos.arrays:
            assert np.array_equal(pos.arrays[k], val.arrays[k]), k


def test_annotation_round_trips_through_the_manifest(tmp_path: os.PathLike) -> None:
    states = [make_rank_state(N, 2, r, I_SMALL, seed=2) for r in range(2)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL, chunk_rows=5)])
    ckpt = xckpt.open(str(tmp_path))
    (got,) = group_annotations(ckpt).values()
    members = Members(rows=ROWS, metadata=(COUNTS,), weight=WEIGHT, row_aligned=(MOM,), segments=SEG, current_iter=ITER)
    want = GroupAnnotation.managed_collision(
        PREFIX, RAW, members, input_size=I_SMALL, row_bounds=ceil_bounds(N, 2), rank_by=(COUNTS,)
    )
    assert got == want
    assert got.names() == [RAW, ROWS, COUNTS, WEIGHT, MOM, SEG, ITER]
    assert {n: ckpt.info(n).value_range for n in got.names()} == {n: want.value_range(n) for n in got.names()}


@pytest.mark.parametrize(
    ("w2", "force", "path", "why"),
    [(1, None, "position", "position slicing equals the value path"),
     (1, "value", "value", r"forced \(force_path='value'\)"),
     (3, None, "value", "not unions of the 2 saved ranks'.*input owner")],
)
def test_read_plan_says_which_path_and_why(tmp_path: os.PathLike, w2: int, force: str | None, path: str, why: str) -> None:
    states = [make_rank_state(N, 2, r, I_SMALL, seed=4) for r in range(2)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL, chunk_rows=5)])
    ckpt = xckpt.open(str(tmp_path))
    ann = group_annotations(ckpt)[RAW]
    plans = [plan_rank_read(ann, ckpt.info(RAW), r, w2, force_path=force) for r in range(w2)]
    assert plans == [plan_rank_read(ann, ckpt.info(RAW), r, w2, force_path=force) for r in range(w2)]  # pure
    for p in plans:
        assert p.path == path and re.search(why, p.reason), p.reason
        ilo, ihi = p.input_range
        # exactly the key chunks whose range meets the rank's inputs (value) or lie in its rows (position)
        for c in ckpt.info(RAW).chunks:
            if path == "value":
                meets = c.value_range is not None and c.value_range[0] < ihi and ilo < c.value_range[1]
            else:
                meets = True  # one new rank holds every saved rank's rows
            assert (c in p.key_chunks) == meets
    assert sum(len(p.key_chunks) for p in plans) >= len([c for c in ckpt.info(RAW).chunks if c.value_range])


def test_save_plan_is_a_pure_function_of_the_state() -> None:
    st = named(make_rank_state(N, 2, 1, I_SMALL, seed=8))
    members = Members(rows=ROWS, metadata=(COUNTS,), weight=WEIGHT, segments=SEG, current_iter=ITER)
    ann = GroupAnnotation.managed_collision(PREFIX, RAW, members, input_size=I_SMALL, row_bounds=ceil_bounds(N, 2))
    local = {n: LocalRows(st[n]) for n in ann.names()}
    plan, arrays = plan_mc_save(ann, 1, local, chunk_rows=5)
    again, _ = plan_mc_save(ann, 1, local, chunk_rows=5)
    assert plan == again
    # rank 1 of 2 holds rows [24, 48) and input ids [5000, 10000); its used keys are cut every 5
    used = int(np.count_nonzero(st[RAW] != M))
    key_writes = [w for w in plan.writes if w.name == RAW]
    assert [(w.start, w.stop) for w in key_writes][:2] == [(0, 5), (5, 10)]
    assert key_writes[0].chunk_range[0] == 5000 and key_writes[-1].chunk_range is None
    assert key_writes[-2].chunk_range[1] == 10_000 and key_writes[-2].stop == used
    assert all(w.offset[0] == 24 + w.start for w in key_writes)
    assert [w.name for w in plan.writes if w.name not in (RAW, ROWS, COUNTS)] == [WEIGHT, ITER]  # segments: rank 0
    assert np.array_equal(arrays[RAW], np.sort(st[RAW]))


def test_forcing_position_where_not_equivalent_raises(tmp_path: os.PathLike) -> None:
    states = [make_rank_state(N, 2, r, I_SMALL) for r in range(2)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL)])
    with pytest.raises(ValueRangeError, match="position slicing is not equivalent from 2 to 3"):
        read_group_rank(xckpt.open(str(tmp_path)), RAW, 0, 3, force_path="position")


@pytest.mark.parametrize("w", [2, 4])
def test_read_path_reads_about_one_share(tmp_path: os.PathLike, w: int) -> None:
    n, size, chunk = 600, 2**50, 16
    states = [make_rank_state(n, w, r, size, dim=8, fill=0.9, seed=5) for r in range(w)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(size, chunk_rows=chunk)])
    ckpt = xckpt.open(str(tmp_path))
    buf_row = 3 * 8  # raw, rows, counts
    table = n * buf_row + 2 * n * 8 * 4  # buffers + weight + momentum
    for r in range(3):
        got = read_group_rank(ckpt, RAW, r, 3, box_cost=0)
        stats = got.read
        # MCH buffers: 1/W' of them plus at most one chunk at each end of the rank's input range.
        assert stats.key_bytes <= n * buf_row / 3 + 2 * chunk * buf_row
        # weight + momentum: exactly the saved rows its new rows come from (kept or moved in).
        lo = ceil_bounds(n, 3)[r]
        zch = got.source_rows.size
        moved = int(np.count_nonzero(got.source_rows != np.arange(lo, lo + zch)))
        assert 0 < moved < zch
        assert stats.row_bytes == np.unique(got.source_rows).size * 2 * 8 * 4
        assert stats.bytes == stats.key_bytes + stats.row_bytes + 8 * 1025 + 8 * w
        # the default cost model merges gaps into fewer reads, never past the saved table
        again = read_group_rank(ckpt, RAW, r, 3)
        assert again.read.row_bytes <= (zch + n) * 2 * 8 * 4
        assert all(np.array_equal(again.arrays[k], got.arrays[k]) for k in got.arrays)
    assert table > 0


def test_unannotated_state_is_left_to_the_adapter() -> None:
    plans, owned = split_value_groups({"a": torch.zeros(3)}, None)
    assert plans == [] and owned == set()


def test_torchrec_names_are_found_with_their_weight() -> None:
    flat = {k: torch.from_numpy(v) for k, v in named(make_rank_state(8, 1, 0, 100)).items()}
    plans, owned = split_value_groups(flat, None)
    assert len(plans) == 1 and plans[0].weight == WEIGHT and plans[0].decl.input_size == M
    assert owned == {RAW, ROWS, COUNTS, SEG, ITER, WEIGHT}  # momentum only when declared


def test_declared_missing_tensor_raises() -> None:
    flat = {k: torch.from_numpy(v) for k, v in named(make_rank_state(8, 1, 0, 100)).items()}
    with pytest.raises(ValueRangeError, match="'nope' is not in the state dict"):
        split_value_groups(flat, [ManagedCollision(PREFIX, row_aligned=["nope"])])


# -- bad input ---------------------------------------------------------------------------


def _bad_save(tmp_path: os.PathLike, mutate: str) -> None:
    st = named(make_rank_state(N, 2, 0, I_SMALL))
    if mutate == "raw_range":
        st[RAW][0] = I_SMALL - 1  # belongs to rank 1
        st[RAW][:-1] = np.sort(st[RAW][:-1])
    elif mutate == "raw_dup":
        st[RAW][1] = st[RAW][0]
    elif mutate == "row_range":
        st[ROWS][0] = N - 1
    elif mutate == "row_dup":
        st[ROWS][1] = st[ROWS][0]
    w = xckpt.Writer(str(tmp_path), rank=0, world_size=2, save_id="x")
    flat = {k: torch.from_numpy(v) for k, v in st.items()}
    plans, _ = split_value_groups(flat, [_decl(I_SMALL)])
    save_value_groups(w, flat, plans, 0, 2)


@pytest.mark.parametrize(
    ("mutate", "msg"),
    [("raw_range", rf"{RAW}.* raw id 9999 outside the rank's input range \[0, 5000\)"),
     ("raw_dup", f"{RAW}.* twice"), ("row_range", rf"{ROWS}.* row 47 outside the rank's rows \[0, 24\)"),
     ("row_dup", f"{ROWS}.* twice")],
)
def test_save_rejects_bad_state(tmp_path: os.PathLike, mutate: str, msg: str) -> None:
    with pytest.raises(ValueRangeError, match=msg):
        _bad_save(tmp_path, mutate)


def _edit_manifest(path: str, fn) -> None:
    p = os.path.join(path, "xckpt.json")
    with open(p) as f:
        m = json.load(f)
    fn(m["tensors"] if isinstance(m["tensors"], dict) else {t["name"]: t for t in m["tensors"]})
    with open(p, "wb") as f:  # as a hostile writer would: the checksum recomputed
        f.write(xckpt.manifest.manifest_bytes(m))


def _corrupt(kind: str):
    def fn(ts: dict) -> None:
        key = ts[RAW]
        if kind == "chunk_range":  # a chunk claims a range that misses its keys
            c = next(c for c in key["chunks"] if c.get("value_range") and c["offset"] == [0])
            c["value_range"] = [c["value_range"][0], c["value_range"][0] + 1]
            for name in (ROWS, COUNTS):
                for c2 in ts[name]["chunks"]:
                    if c2["offset"] == [0]:
                        c2["value_range"] = c["value_range"]
        elif kind == "rank_range":  # a chunk's range lies outside its rank's input block
            for name in (RAW, ROWS, COUNTS):
                c = next(c for c in ts[name]["chunks"] if c.get("value_range") and c["offset"] == [0])
                c["value_range"] = [0, I_SMALL]
        elif kind == "row_bounds":
            key["value_range"]["attrs"]["row_bounds"] = [0, 20, N]
        elif kind == "columns":
            ts[COUNTS]["chunks"][0]["value_range"] = None
        elif kind == "members":
            key["value_range"]["attrs"]["members"]["rows"] = 5
        elif kind == "not_ints":
            key["value_range"]["attrs"]["input_size"] = "big"
        elif kind == "input_size":
            key["value_range"]["attrs"]["row_bounds"] = [0, 24, N]
            key["value_range"]["attrs"]["input_size"] = I_SMALL + 1
    return fn


@pytest.mark.parametrize(
    ("kind", "msg"),
    [("chunk_range", "outside its chunk's range"), ("rank_range", "outside its rank's input range"),
     ("row_bounds", "row_bounds .* do not split|maps to row"), ("columns", "chunks differ from those of the key"),
     ("input_size", "input_bounds / domain disagree"), ("members", "'members' must name tensors"),
     ("not_ints", "are not integers")],
)
def test_load_rejects_disagreeing_annotation_and_loads_nothing(tmp_path: os.PathLike, kind: str, msg: str) -> None:
    states = [make_rank_state(N, 2, r, I_SMALL, seed=1) for r in range(2)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL, chunk_rows=4)])
    _edit_manifest(str(tmp_path), _corrupt(kind))
    raised = _errors_loading_at_3_ranks(xckpt.open(str(tmp_path)))
    assert raised, "no rank raised"
    assert str(tmp_path) in raised[0] or RAW in raised[0]
    assert re.search(msg, raised[0]), raised[0]


def _errors_loading_at_3_ranks(ckpt: xckpt.Checkpoint) -> list[str]:
    """Load the group at each of 3 simulated ranks; the ValueRangeError messages raised.

    A rank that raises must have left every target as it was (nothing partly loaded).
    """
    raised = []
    for r in range(3):
        tgt = {k: torch.from_numpy(v) for k, v in empty_target(N, 3, r).items()}
        before = {k: v.clone() for k, v in tgt.items()}
        try:
            load_value_groups(ckpt, tgt, r, 3, None, False)
        except ValueRangeError as e:
            raised.append(str(e))
            assert all(torch.equal(tgt[k], before[k]) for k in tgt)
    return raised


def test_target_of_wrong_size_raises_before_filling(tmp_path: os.PathLike) -> None:
    states = [make_rank_state(N, 2, r, I_SMALL) for r in range(2)]
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL)])
    tgt = {k: torch.from_numpy(v) for k, v in empty_target(N, 3, 0).items()}
    tgt[WEIGHT] = torch.zeros(5, 4)
    before = tgt[RAW].clone()
    with pytest.raises(ShapeMismatchError, match="rebuild_with_output_id_range"):
        load_value_groups(xckpt.open(str(tmp_path)), tgt, 0, 3, None, False)
    assert torch.equal(tgt[RAW], before)


# -- a generic group -----------------------------------------------------------------------


def test_generic_group_redistributes_by_key(tmp_path: os.PathLike) -> None:
    d = ValueGroup("k", domain=100, columns=["v"], empty_marker=-1, rank_by=["v"])
    ranks = [
        {"k": np.array([70, 3, -1, 40]), "v": np.array([1.0, 2.0, 0.0, 3.0], np.float32)},
        {"k": np.array([10, 95, 55, -1]), "v": np.array([4.0, 5.0, 6.0, 0.0], np.float32)},
    ]
    for r, st in enumerate(ranks):
        w = xckpt.Writer(str(tmp_path), rank=r, world_size=2, save_id="g")
        flat = {k: torch.from_numpy(v) for k, v in st.items()}
        plans, owned = split_value_groups(flat, [d])
        assert owned == {"k", "v"}
        save_value_groups(w, flat, plans, r, 2)
        w.commit()
    xckpt.finalize(str(tmp_path), 2, "g")
    ckpt = xckpt.open(str(tmp_path))
    got = []
    for r in range(3):  # blocks of 34: [0,34) [34,68) [68,100)
        tgt = {"k": torch.zeros(3, dtype=torch.int64), "v": torch.zeros(3)}
        _, ev = load_value_groups(ckpt, tgt, r, 3, None, False)
        got.append((tgt["k"].tolist(), tgt["v"].tolist(), ev["k"]))
    assert got == [([3, 10, -1], [2.0, 4.0, 0.0], 0), ([40, 55, -1], [3.0, 6.0, 0.0], 0), ([70, 95, -1], [1.0, 5.0, 0.0], 0)]
    tgt = {"k": torch.zeros(1, dtype=torch.int64), "v": torch.zeros(1)}
    with pytest.warns(UserWarning, match="evicted 1"):
        _, ev = load_value_groups(ckpt, tgt, 0, 3, None, False)
    assert tgt["k"].tolist() == [10] and ev == {"k": 1}  # v=4 beats v=2


def _rewrite(src: str, dst: str, mutate) -> None:
    """Copy a checkpoint chunk by chunk (same annotation), letting ``mutate`` change the data."""
    ck = xckpt.open(src)
    writers = {r: xckpt.Writer(dst, rank=r, world_size=ck.world_size, save_id="bad") for r in range(ck.world_size)}
    for name in ck.names():
        t = ck.info(name)
        for w in writers.values():
            w.declare(name, t.np_dtype, t.shape, value_range=t.value_range)
        for c in t.chunks:
            data = ck.read(name, tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape)))
            mutate(name, c, data)
            writers[c.rank].write(name, data, global_shape=t.shape, offset=c.offset, value_range=t.value_range,
                                  chunk_value_range=c.value_range)
    for w in writers.values():
        w.commit()
    xckpt.finalize(dst, ck.world_size, "bad")


def _dup_raw(name, c, data) -> None:
    if name == RAW and c.value_range is not None and c.offset == (0,):
        data[1] = data[0]


def _dup_row(name, c, data) -> None:
    if name == ROWS and c.value_range is not None and c.offset == (0,):
        data[1] = data[0]


def _seg_off(name, c, data) -> None:
    if name == SEG:
        data[1] = 5


def _key_out(name, c, data) -> None:
    if name == RAW and c.value_range is not None and c.offset == (0,):
        data[0] = c.value_range[1]


@pytest.mark.parametrize(
    ("mutate", "msg"),
    [(_dup_raw, "holds key .* twice"), (_dup_row, "row .* is mapped by two raw ids"),
     (_key_out, "outside its chunk's range"), (_seg_off, "holds .* but row_bounds are")],
    ids=["duplicate-raw-id", "duplicate-row", "key-outside-range", "segments-disagree"],
)
def test_bad_data_in_a_checkpoint_raises_naming_the_tensor(tmp_path: os.PathLike, mutate, msg: str) -> None:
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    states = [make_rank_state(N, 2, r, I_SMALL, seed=2) for r in range(2)]
    save_sim(good, [named(s) for s in states], [_decl(I_SMALL, chunk_rows=6)])
    _rewrite(good, bad, mutate)
    raised = _errors_loading_at_3_ranks(xckpt.open(bad))
    assert raised and all(PREFIX in m for m in raised)
    assert any(re.search(msg, m) for m in raised), raised


@pytest.mark.parametrize(
    ("n", "w", "w2"),
    [(10, 3, 4), (10, 4, 3), (5, 2, 4), (5, 4, 2), (7, 4, 1)],
    ids=["10rows-3to4", "10rows-4to3", "5rows-2to4-empty-rank", "5rows-4to2-empty-saved-rank", "7rows-4to1"],
)
def test_uneven_and_empty_shards(tmp_path: os.PathLike, n: int, w: int, w2: int) -> None:
    """Ceil splits leave short and empty ranks (5 rows over 4: 2, 2, 1, 0); their ids are evicted, not lost."""
    states = [make_rank_state(n, w, r, I_SMALL, fill=1.0, seed=n + w) for r in range(w)]
    assert any(s["raw"].size <= 1 for s in states) or n % w
    table = id_table(states, ceil_bounds(n, w))
    save_sim(str(tmp_path), [named(s) for s in states], [_decl(I_SMALL, chunk_rows=2)])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded, ev = load_sim(str(tmp_path), n, w2)
    assert check_lookups(table, loaded, I_SMALL, n) == sum(e[PREFIX] for e in ev)
    assert [st[RAW].size for st in loaded] == [b - a for a, b in zip(ceil_bounds(n, w2), ceil_bounds(n, w2)[1:])]


@settings(max_examples=60, deadline=None)
@given(
    w=hst.integers(1, 5), w2=hst.integers(1, 5), n=hst.integers(1, 40), size=hst.integers(1, 10_000),
    fill=hst.floats(0.0, 1.0), seed=hst.integers(0, 1000),
)
def test_assemble_invariants(w: int, w2: int, n: int, size: int, fill: float, seed: int) -> None:
    """For any layouts: rows stay a permutation with the miss row last, every kept id sits on its
    input owner, the fullest ranks keep exactly their capacity, and position slicing agrees where valid."""
    size = max(size, w)  # every saved rank owns some of the domain
    old, new = MCLayout(size, ceil_bounds(n, w)), MCLayout(size, ceil_bounds(n, w2))
    states = [make_rank_state(n, w, r, size, fill=fill, seed=seed) for r in range(w)]
    raw = np.concatenate([s["raw"] for s in states])
    rows = np.concatenate([s["rows"] for s in states])
    cnt = np.concatenate([s["counts"] for s in states])
    used = raw != M
    own = new.owner(raw[used])
    kept = 0
    for r in range(w2):
        lo, hi = new.rows(r)
        m = own == r
        a = assemble_rank(raw[used][m], rows[used][m], {"c": cnt[used][m]}, new, r, ["c"])
        assert sorted(a.rows.tolist()) == list(range(lo, hi))
        if hi > lo:
            assert a.rows[-1] == hi - 1 and a.raw[-1] == M
        got = a.raw[a.raw != M]
        assert np.all(np.diff(a.raw) >= 0) and np.all(new.owner(got) == r)
        assert got.size == min(int(m.sum()), max(hi - lo - 1, 0)) and a.evicted == int(m.sum()) - got.size
        kept += got.size
        if position_equivalent(old, new):
            p = position_rank(raw[lo:hi], rows[lo:hi], {"c": np.where(raw[lo:hi] == M, 0, cnt[lo:hi])}, new, r)
            assert p.raw.tolist() == a.raw.tolist() and p.rows.tolist() == a.rows.tolist()
            assert p.meta["c"].tolist() == a.meta["c"].tolist()
            assert p.source_rows.tolist() == a.source_rows.tolist()
    assert kept <= int(used.sum())
