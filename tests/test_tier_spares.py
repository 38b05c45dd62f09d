"""The local tier's spare files (`xckpt.manager._spares`): a dropped step's files, reused.

A rank releases what it owns of a dropped step (manifests first, data to its spares);
the next step's own write (`recycle_under`) and replica receive (`claim`) reuse them, in
place; `Mappings` keeps a file's mapping for the rounds until it comes back.
"""

import os
import threading

import numpy as np
import pytest

from xckpt.manager._spares import Mappings, claim, place, release, tidy
from xckpt.native import _fileio


def _part(step_dir, part: int, files: dict[str, bytes], space: str | None = None) -> None:
    """Rank `part`'s part of a step: its manifest and data files (in `data/<space>`)."""
    os.makedirs(os.path.join(step_dir, "ranks"), exist_ok=True)
    with open(os.path.join(step_dir, "ranks", f"{part}.json"), "w") as fh:
        fh.write("{}")
    for rel, data in files.items():
        path = os.path.join(step_dir, "data", space or str(part), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)


def _tree(root) -> dict[str, bytes]:
    out = {}
    for b, _d, ns in os.walk(root):
        for n in ns:
            with open(os.path.join(b, n), "rb") as fh:
                out[os.path.relpath(os.path.join(b, n), root)] = fh.read()
    return out


def test_release_moves_owned_parts_to_the_spares_and_leaves_the_rest(tmp_path):
    step = str(tmp_path / "4")
    _part(step, 0, {"t/a/c.0.0": b"own"})
    _part(step, 2, {"t/b/c.0.0": b"replica", "t/b/zarr.json": b"{}"})
    _part(step, 1, {"t/c/c.0.0": b"another rank's"})  # the node's other rank owns it
    spares = str(tmp_path / ".spare" / "0")
    os.makedirs(os.path.join(spares, "2", "stale"))  # spares a round did not use: replaced
    release(step, 0, [2], spares)
    tidy(step)
    assert _tree(spares) == {"0/t/a/c.0.0": b"own", "2/t/b/c.0.0": b"replica", "2/t/b/zarr.json": b"{}"}
    # what rank 1 owns is untouched, its manifest included; the directory stays for it
    assert sorted(os.listdir(os.path.join(step, "ranks"))) == ["1.json"]
    assert _tree(os.path.join(step, "data")) == {"1/t/c/c.0.0": b"another rank's"}
    release(step, 1, [], None)  # without spares: deleted
    tidy(step)
    assert not os.path.exists(step)


def test_release_of_an_overwritten_part_keeps_one_key_space(tmp_path):
    step = str(tmp_path / "4")
    _part(step, 3, {"t/a/c.0.0": b"first"}, space="3")
    _part(step, 3, {"t/a/c.0.0": b"second"}, space="3.ab12")
    _part(step, 31, {"t/a/c.0.0": b"rank 31"})  # "31" is not a key space of rank 3
    release(step, 3, [], str(tmp_path / "sp"))
    assert _tree(tmp_path / "sp") == {"3/t/a/c.0.0": b"first"}
    assert _tree(os.path.join(step, "data")) == {"31/t/a/c.0.0": b"rank 31"}


def test_ranks_of_a_node_releasing_one_step_at_once(tmp_path):
    """Two ranks of a node (each with its own part and a replica) release the same step at
    the same time: each gets exactly its files as spares, and the step's directory goes."""
    for trial in range(20):
        step = str(tmp_path / str(trial))
        files = {f"t/{k}/c.0.0": bytes([k]) * 64 for k in range(10)}
        for part in (0, 1, 2, 3):
            _part(step, part, files)
        errors: list[BaseException] = []

        def go(rank, src, step=step, errors=errors, trial=trial):
            try:
                release(step, rank, [src], str(tmp_path / f"sp{trial}" / str(rank)))
                tidy(step)
            except BaseException as e:  # recorded for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=go, args=(r, r + 2)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and not os.path.exists(step)
        for r in (0, 1):
            got = _tree(tmp_path / f"sp{trial}" / str(r))
            assert got == {f"{p}/{n}": d for p in (r, r + 2) for n, d in files.items()}


def test_claim_renames_a_spare_and_maps_it_at_the_new_size(tmp_path):
    spares, step = str(tmp_path / "sp"), str(tmp_path / "7")
    os.makedirs(os.path.join(spares, "2", "t", "a"))
    with open(os.path.join(spares, "2", "t", "a", "c.0.0"), "wb") as fh:
        fh.write(b"x" * 100)
    os.makedirs(os.path.join(step, "data", "2.tok", "t", "a"))
    path = os.path.join(step, "data", "2.tok", "t", "a", "c.0.0")
    maps = Mappings(3)
    arr = claim(spares, 2, "data/2.tok/t/a/c.0.0", path, 60, maps)
    assert arr is not None and arr.shape == (60,) and arr.flags.writeable
    arr[:] = np.arange(60, dtype=np.uint8)
    del arr
    maps.close()
    with open(path, "rb") as fh:
        assert fh.read() == bytes(range(60))  # written through the mapping, cut to 60 bytes
    assert not os.path.exists(os.path.join(spares, "2", "t", "a", "c.0.0"))
    # no spare of that name, another source's, a name outside a key space, nothing to map
    assert claim(spares, 2, "data/2/t/b/c.0.0", os.path.join(step, "x"), 10, maps) is None
    assert claim(spares, 5, "data/5/t/a/c.0.0", os.path.join(step, "x"), 10, maps) is None
    assert claim(spares, 2, "c.0.0", os.path.join(step, "x"), 10, maps) is None
    assert claim(spares, 2, "data/2/t/a/c.0.0", os.path.join(step, "x"), 0, maps) is None


def test_mappings_are_reused_for_the_same_file_and_size_then_dropped(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as fh:
        fh.write(b"\0" * 8192)
    maps = Mappings(2)

    def mapped(size):
        fd = os.open(path, os.O_RDWR)
        try:
            return maps.map(fd, size)
        finally:
            os.close(fd)

    a = mapped(8192)
    a[0] = 7
    b = mapped(8192)
    assert b[0] == 7 and np.shares_memory(a, b)  # the same mapping
    c = mapped(4096)  # another size: mapped anew, the file cut
    assert c.shape == (4096,) and not np.shares_memory(a, c) and os.path.getsize(path) == 4096
    for _ in range(3):
        maps.next_round()
    assert not maps._held  # no round used it for longer than `rounds`: dropped


def test_the_writer_writes_over_a_placed_file_and_cuts_it(tmp_path):
    """`recycle_under`: a shard file put in place is written over (the same inode) and cut
    to its size; the array reads back exactly; other directories are not asked."""
    tier, spares = str(tmp_path / "tier"), str(tmp_path / "tier" / ".spare" / "0")
    key = "t/a"
    old = os.path.join(spares, "0", key, "c.0.0")
    os.makedirs(os.path.dirname(old))
    with open(old, "wb") as fh:
        fh.write(b"\xff" * (1 << 20))  # larger than the new shard: the tail must go
    ino = os.stat(old).st_ino
    asked: list[str] = []

    def put(path):
        asked.append(path)
        return place(spares, 0, tier, path)

    arr = np.arange(64 * 100, dtype=np.float32).reshape(64, 100)
    _fileio.recycle_under(tier, put)
    try:
        _fileio.write_arrays(os.path.join(tier, "5", "data", "0"), [_fileio.ArrayWrite(key, "float32", arr, (16, 100), "files")])
        _fileio.write_arrays(str(tmp_path / "elsewhere"), [_fileio.ArrayWrite(key, "float32", arr, (16, 100), "files")])
    finally:
        _fileio.recycle_under(tier, None)
    new = os.path.join(tier, "5", "data", "0", key, "c.0.0")
    assert asked == [new] and os.stat(new).st_ino == ino and not os.path.exists(old)
    fresh = str(tmp_path / "elsewhere" / key / "c.0.0")
    with open(new, "rb") as a, open(fresh, "rb") as b:
        assert a.read() == b.read()  # byte for byte what a fresh write gives


@pytest.mark.parametrize("path", ["5/data/1/t/a/c.0.0", "5/ranks/0.json", "x/data/0/t/a/c.0.0", "5/data/0"])
def test_place_only_for_the_ranks_own_files(tmp_path, path):
    spares = str(tmp_path / ".spare" / "0")
    os.makedirs(os.path.join(spares, "0", "t", "a"))
    with open(os.path.join(spares, "0", "t", "a", "c.0.0"), "wb") as fh:
        fh.write(b"x")
    assert place(spares, 0, str(tmp_path), str(tmp_path / path)) is False


# -- two ranks on two nodes: spares that grow, shrink, appear and go --------------------------

_SHAPES = {  # step -> tensor -> rows (x 4096 float32 columns, split over 2 ranks: each shard a file of its own)
    1: {"a": 64, "b": 40},
    2: {"a": 64, "b": 40},
    3: {"a": 96, "b": 40, "c": 40},
    4: {"a": 48, "c": 40},
    5: {"a": 48, "c": 40},
}


def _files(step_dir: str, part: int) -> dict[str, bytes]:
    return _tree(os.path.join(step_dir, "data", str(part)))


def _changing_shapes(rank: int, world: int, base: str) -> dict:
    import torch

    import xckpt.manager._replicate as rep
    from xckpt.manager import CheckpointManager

    rep.MAP_AT, rep.CHUNK = 16 << 10, 48 << 10  # the larger files in several messages each
    node = os.path.join(base, "AB"[rank])
    m = CheckpointManager(os.path.join(base, "root"), local=node, local_every=1, local_keep=1, replicas=1,
                          ranks_per_node=1, save_every=100, handle_preemption=False)
    out: dict = {"same": [], "reused": [], "inodes": []}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict:
        g = torch.Generator().manual_seed(step)
        full = {n: torch.randn(rows, 4096, generator=g) for n, rows in _SHAPES[step].items()}
        return {n: DTensor.from_local(t.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                      shape=t.shape, stride=t.stride()) for n, t in full.items()}

    for step in _SHAPES:
        sd = state(step)
        m.save(step, sd)
        m.wait()
        torch.distributed.barrier()  # both nodes' copies of the step are stored
        other = 1 - rank
        mine = os.path.join(node, str(step))
        theirs = os.path.join(base, "AB"[other], str(step))
        # this node's replica of the other rank's part is byte for byte the other node's own copy
        out["same"].append(_files(mine, other) == _files(theirs, other) != {})
        out["reused"].append(m._tiers.rep.reused_bytes)
        own = os.path.join(mine, "data", str(rank))
        out["inodes"].append({os.path.relpath(os.path.join(b, n), own): os.stat(os.path.join(b, n)).st_ino
                              for b, _d, ns in os.walk(own) for n in ns if n.startswith("c.")})
        torch.distributed.barrier()  # neither rank's next round drops this step before the other looked
    target = {n: t * 0 for n, t in sd.items()}
    m.restore(target)
    out["restored"] = all(torch.equal(target[n].to_local(), t.to_local()) for n, t in sd.items())
    m.close()
    return out


def test_spares_follow_tensors_that_grow_shrink_appear_and_go(tmp_path):
    """local_keep=1: each round reuses the files of the step two before. Step 3's `a` is
    larger than its spare (step 1's), `c` has none (received through buffers, beside `a`'s
    mapped spare); step 5's `a` is smaller than step 3's, and `b` left step 3 for good. Every replica is byte for byte its
    source's files, and the last step restores bit for bit."""
    from dist_utils import run_ranks

    for r in run_ranks(_changing_shapes, 2, str(tmp_path), timeout=240):
        assert r["same"] == [True] * 5
        # step 1 is dropped after step 2: steps 3, 4 and 5 receive into the spares of 1, 2 and 3
        assert r["reused"][:2] == [0, 0] and all(n > 0 for n in r["reused"][2:]), r["reused"]
        # and write over them: the same inodes wherever a tensor's file is there both times
        ino = r["inodes"]
        for i in range(2, 5):
            both = set(ino[i]) & set(ino[i - 2])
            assert both and all(ino[i][k] == ino[i - 2][k] for k in both), ino
        assert set(ino[2]) - set(ino[0])  # c's file came fresh
        assert r["restored"]
