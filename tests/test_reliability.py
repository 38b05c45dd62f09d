"""Hard to break: killed saves, byte flips, racing saves, full disks, ``python -O``.

Each test prints its figures (trials, refused, complete, silent-wrong); the README's
reliability section quotes them. ``XCKPT_SOAK=1`` (``make soak``) runs many more
trials of the same tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crash_utils import SOAK, Tally, data, fractions, judge, run_killed, same
from dist_utils import RankError, RankTimeout, run_ranks

import xckpt
from xckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptChunkError,
    IncompleteCheckpointError,
    ManifestError,
    XckptError,
)

TRIALS = {"numpy": 40, "overwrite": 40, "rank_local": 30, "torch": 8} if SOAK else {
    "numpy": 6, "overwrite": 5, "rank_local": 4, "torch": 1}


# -- saves killed at chosen points ---------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "overwrite", "rank_local"])
def test_killed_saves_never_open_wrong(tmp_path, kind):
    """SIGKILL at points spread over the whole save: the location opens as all of the
    new save, all of the old one (an overwrite killed before it claimed), or not at all;
    an earlier checkpoint at another path always opens whole."""
    tally = Tally(f"killed {kind} saves")
    earlier = Tally("earlier checkpoints")
    n = TRIALS[kind]
    for i, frac in enumerate(fractions(n, seed=hash(kind) % 1000)):
        root = tmp_path / f"t{i}"
        root.mkdir()
        code = run_killed(kind, str(root), i, frac)
        assert code in (0, -9), f"worker exited with {code} (not killed, not clean): see its stderr"
        if not (root / "target").exists() and kind != "numpy":
            continue  # killed before the first (complete) save began: nothing to judge
        judge(tally, str(root / "target"), data(i), old=data(i + 1000) if kind != "numpy" else None)
        if kind == "numpy" and (root / "earlier" / "xckpt.json").exists():
            judge(earlier, str(root / "earlier"), data(i + 1000))
    print(f"\n{tally.line()}  [{', '.join(sorted(set(tally.notes)))}]")
    if earlier.trials:
        print(earlier.line())
    assert tally.silent_wrong == 0, tally.notes
    assert earlier.silent_wrong == 0 and earlier.refused == 0, earlier.notes
    assert tally.trials >= n - 1
    # A location a killed save left behind takes a new save with overwrite=True.
    last = tmp_path / f"t{n - 1}" / "target"
    xckpt.save(data(5), str(last), overwrite=True)
    assert same(xckpt.load(str(last)), data(5))


def _torch_killed_body(rank: int, world: int, root: str, frac: float) -> None:
    import torch
    import torch.distributed as dist
    from crash_utils import _arm, _timed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": distribute_tensor(torch.randn(512, 384, generator=g), mesh, [Shard(0)]),
        "e": distribute_tensor(torch.randn(64, 96, generator=g).to(torch.bfloat16), mesh, [Shard(1)]),
        "bias": torch.arange(40, dtype=torch.float32),
        **{f"small.{i}": torch.full((32,), float(i)) for i in range(60)},
        "step": 9,
        "rng": xt.PerRank({"rank": rank}),
    }
    xt.save(sd, os.path.join(root, "warm"))  # tensorstore and the process group warmed up
    dist.barrier()
    t = _timed(lambda: xt.save(sd, os.path.join(root, "earlier")))
    dist.barrier()
    _arm(frac * t)
    xt.save(sd, os.path.join(root, "target"))
    time.sleep(0.05)


@pytest.mark.slow
def test_killed_coordinated_torch_saves(tmp_path):
    """2 gloo ranks (DTensors, replicated and small tensors, objects), both killed part way."""
    tally = Tally("killed coordinated torch saves (2 gloo ranks)")
    fracs = fractions(TRIALS["torch"], seed=7) if SOAK else [0.5]  # one kill among the data writes
    for i, frac in enumerate(fracs):
        root = tmp_path / f"t{i}"
        root.mkdir()
        try:
            run_ranks(_torch_killed_body, 2, str(root), frac, timeout=120)
        except (RankError, RankTimeout) as e:
            assert "died without a result" in str(e) or "exit codes" in str(e) or "-9" in str(e), str(e)[-2000:]
        want = xckpt.load(str(root / "earlier"), per_rank="list")
        judge(tally, str(root / "target"), want)
    print(f"\n{tally.line()}  [{', '.join(sorted(set(tally.notes)))}]")
    assert tally.silent_wrong == 0, tally.notes


def test_rank_local_overwrite_with_fewer_ranks_opens(tmp_path):
    """Three ranks save A; two overwrite with B and commit: B opens (A's ranks/2.json is ignored)."""
    path = str(tmp_path / "c")
    a, b = np.arange(12, dtype=np.float32).reshape(6, 2), -np.arange(12, dtype=np.float32).reshape(6, 2)
    for world, sid, arr in [(3, "A", a), (2, "B", b)]:
        rows = np.array_split(np.arange(6), world)
        for r in range(world):
            w = xckpt.Writer(path, rank=r, world_size=world, save_id=sid, overwrite=sid == "B")
            w.write("t", arr[rows[r][0] : rows[r][-1] + 1], global_shape=(6, 2), offset=(int(rows[r][0]), 0))
            w.commit()
    assert (tmp_path / "c" / "ranks" / "2.json").exists()  # A's leftover
    ck = xckpt.open(path)
    assert ck.world_size == 2 and ck.save_id == "B" and ck.read("t").tobytes() == b.tobytes()
    # Part way (rank 0 of B committed, rank 1 still A's): refused, never a mix.
    w = xckpt.Writer(path, rank=0, world_size=2, save_id="C", overwrite=True)
    w.write("t", a[:3], global_shape=(6, 2), offset=(0, 0))
    w.commit()
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\] belong to another save"):
        xckpt.open(path)


# -- byte flips ---------------------------------------------------------------------


_STAMP = [2_000_000_000 * 10**9]


def _rewrite(f: Path, data: bytes) -> None:
    """Rewrite ``f`` in place with a new modification time. tensorstore's file kvstore
    tells versions of a file apart by size and mtime, so a same-size rewrite within one
    clock tick of a read would look unchanged to its OCDBT caches (seen once in a full
    run); a saved checkpoint's files are never rewritten in place."""
    f.write_bytes(data)
    _STAMP[0] += 10**9
    os.utime(f, ns=(_STAMP[0], _STAMP[0]))


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_byte_flips_over_every_file_never_load_wrong(tmp_path, storage):
    """Flip bytes at spread positions of every file of a checkpoint (manifests, zarr metadata,
    chunks, OCDBT manifest and B-tree): a load raises an XckptError or returns exactly the
    saved values; verify() agrees with the load."""
    want = data(3, small=20)
    root = tmp_path / "c"
    xckpt.save(want, str(root), storage=storage)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    per_file = 40 if SOAK else 6
    rng = np.random.default_rng(1)
    flips = detected = harmless = silent = verify_missed = 0
    notes: set[str] = set()
    for f in files:
        orig = f.read_bytes()
        size = len(orig)
        spots = {0, size - 1, size // 2, *rng.integers(0, size, per_file).tolist()}
        for pos in sorted(spots)[: per_file + 3]:
            raw = bytearray(orig)
            raw[pos] ^= 1 << int(rng.integers(0, 8))
            f.write_bytes(bytes(raw))
            flips += 1
            try:
                got = xckpt.load(str(root))
            except XckptError as e:
                detected += 1
                notes.add(type(e).__name__)
            else:
                if same(got, want):
                    harmless += 1
                else:
                    silent += 1
                    notes.add(f"SILENT {f.relative_to(root)}@{pos}")
                try:
                    problems = xckpt.open(str(root)).verify()
                except XckptError:
                    problems = ["refused at open"]
                if not same(got, want) and not problems:
                    verify_missed += 1
        f.write_bytes(orig)
    print(
        f"\nbyte flips ({storage}): {len(files)} files, {flips} flips, {detected} refused, "
        f"{harmless} harmless (bytes no reader uses), {silent} silent-wrong  [{', '.join(sorted(notes))}]"
    )
    assert silent == 0 and verify_missed == 0, notes
    assert detected > flips // 2
    assert same(xckpt.load(str(root)), want)


def test_flipped_manifest_byte_is_a_manifest_error(tmp_path):
    """The reproductions of issue 13: a renamed tensor, a changed object, dropped objects."""
    xckpt.save({"small.161": np.arange(3), "lr": 0.5, "names": ["a"]}, str(tmp_path / "c"))
    p = tmp_path / "c" / "xckpt.json"
    orig = p.read_bytes()
    for old, new in [(b"small.161", b"small.,61"), (b"0.5", b"0.7"), (b'"objects"', b'"oljects"')]:
        p.write_bytes(orig.replace(old, new, 1))
        with pytest.raises(ManifestError, match=r"xckpt.json fails its checksum: the file is corrupt"):
            xckpt.open(str(tmp_path / "c"))
    body = json.loads(orig)
    for field in ("tensors", "objects"):
        d = {k: v for k, v in body.items() if k != field}
        p.write_bytes(xckpt.manifest.manifest_bytes(d))
        with pytest.raises(ManifestError, match=rf"lacks the required field '{field}'"):
            xckpt.open(str(tmp_path / "c"))
    p.write_bytes(orig[: orig.rindex(b',"checksum"')] + b"}")
    with pytest.raises(ManifestError, match="lacks its checksum"):
        xckpt.open(str(tmp_path / "c"))


# -- racing saves -------------------------------------------------------------------------


def _race(fns):
    barrier = threading.Barrier(len(fns))
    out: list = [None] * len(fns)

    def run(i):
        barrier.wait()
        try:
            out[i] = ("ok", fns[i]())
        except XckptError as e:
            out[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_racing_saves_one_winner(tmp_path):
    """Two saves racing for one new path: one wins, the other raises CheckpointExistsError
    having written nothing; the location opens as the winner's save."""
    n = 30 if SOAK else 6
    for i in range(n):
        path = str(tmp_path / f"c{i}")
        a, b = data(i, small=10), data(i + 100, small=10)
        res = _race([lambda a=a, path=path: xckpt.save(a, path), lambda b=b, path=path: xckpt.save(b, path)])
        kinds = sorted(r[0] for r in res)
        assert kinds == ["err", "ok"], res
        err = next(r[1] for r in res if r[0] == "err")
        assert isinstance(err, CheckpointExistsError), err
        assert "overwrite=True" in str(err)
        winner = a if res[0][0] == "ok" else b
        assert same(xckpt.load(path), winner)
    print(f"\nracing saves: {n} trials, {n} with one winner and one CheckpointExistsError, 0 silent-wrong")


def test_racing_overwrites_give_all_of_one(tmp_path):
    """Two saves racing with overwrite=True over an old save: all of one or all of the other."""
    n = 30 if SOAK else 6
    tally = Tally("racing overwrites")
    for i in range(n):
        path = str(tmp_path / f"c{i}")
        storage = ("ocdbt", "plain", "files")[i % 3]
        xckpt.save(data(i + 200, small=10), path, storage=storage)
        a, b = data(i, small=10), data(i + 100, small=10)
        res = _race([lambda d=d, path=path, storage=storage: xckpt.save(d, path, overwrite=True, storage=storage)
                     for d in (a, b)])
        for kind, val in res:
            assert kind == "ok" or isinstance(val, CheckpointExistsError), val
        got = xckpt.load(path)
        tally.trials += 1
        if same(got, a) or same(got, b):
            tally.complete += 1
        else:
            tally.silent_wrong += 1
        dirs = sorted(p.name for p in (Path(path) / "data").iterdir() if any(p.rglob("*.*")) or any(
            q.is_file() for q in p.rglob("*")))
        assert len(dirs) == 1, dirs  # the replaced saves' data is gone
    print(f"\n{tally.line()}")
    assert tally.silent_wrong == 0


def _race_worker(path: str, seed: int, start: float) -> None:
    time.sleep(max(0.0, start - time.time()))
    try:
        xckpt.save(data(seed, small=10), path)
    except CheckpointExistsError:
        os._exit(3)


def test_racing_save_processes(tmp_path):
    """The same race between two processes (the claim is a conditional write on disk)."""
    from crash_utils import _ctx

    n = 20 if SOAK else 3
    for i in range(n):
        path = str(tmp_path / f"c{i}")
        start = time.time() + 0.3
        procs = [_ctx().Process(target=_race_worker, args=(path, s, start)) for s in (i, i + 100)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        codes = sorted(p.exitcode for p in procs)
        assert codes == [0, 3], codes
        winner = i if procs[0].exitcode == 0 else i + 100
        assert same(xckpt.load(path), data(winner, small=10))


# -- storage failures ------------------------------------------------------------------


_FSIZE = textwrap.dedent(
    """
    import errno, json, os, resource, signal, sys
    import numpy as np
    import xckpt
    from xckpt.errors import StorageError, XckptError
    root, storage = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    xckpt.save({"a": np.arange(10.0)}, root + "/earlier", storage=storage)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    out = {}
    big = {"w": np.random.default_rng(0).standard_normal((700, 700)), "b": np.ones(4)}
    try:
        xckpt.save(big, root + "/c", storage=storage)
        out["raised"] = None
    except XckptError as e:
        out.update(raised=type(e).__name__, errno=e.errno, msg=str(e), cause=type(e.__cause__).__name__,
                   oserror=isinstance(e, OSError))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        xckpt.open(root + "/c")
        out["after"] = "opens"
    except XckptError as e:
        out["after"] = type(e).__name__
    out["earlier"] = xckpt.load(root + "/earlier")["a"].tolist() == list(np.arange(10.0))
    xckpt.save(big, root + "/c", storage=storage)  # no overwrite needed: the failed save withdrew its claim
    got = xckpt.load(root + "/c")
    out["resaved"] = got["w"].tobytes() == big["w"].tobytes()
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_file_too_large_is_a_storage_error(tmp_path, storage):
    """A save under RLIMIT_FSIZE: StorageError (an OSError with errno EFBIG) naming the
    checkpoint and the tensors, the underlying error as its cause; nothing opens; the
    earlier checkpoint is intact; a new save (no overwrite) succeeds once there is room."""
    r = subprocess.run([sys.executable, "-c", _FSIZE, str(tmp_path), storage], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nRLIMIT_FSIZE ({storage}): {out['raised']} errno {out['errno']}: {out['msg'][:200]}")
    assert out["raised"] == "StorageError" and out["oserror"] and out["errno"] == 27  # EFBIG
    # ocdbt goes through tensorstore (its ValueError is the cause); plain local files are
    # written directly (the OSError is).
    assert out["cause"] == {"ocdbt": "ValueError", "plain": "OSError", "files": "OSError"}[storage]
    assert str(tmp_path / "c") in out["msg"] and "'w'" in out["msg"]
    assert "size limit" in out["msg"]
    assert out["after"] == "CheckpointNotFoundError" and out["earlier"] and out["resaved"]


_OPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import xckpt
    from xckpt.errors import ManifestError
    assert False, "asserts must be stripped under -O"  # noqa: B011 - proves -O is on
    """
)


def test_save_and_load_under_python_O(tmp_path):
    """Nothing relies on assert: under -O a save, a load, verify, and a hostile manifest behave."""
    code = _OPT + textwrap.dedent(
        f"""
        root = {str(tmp_path)!r}
        d = {{"w": np.arange(300 * 300, dtype=np.float32).reshape(300, 300), "b": np.arange(5), "o": (1, 2)}}
        xckpt.save(d, root + "/c")
        got = xckpt.load(root + "/c")
        ok = got["w"].tobytes() == d["w"].tobytes() and got["o"] == (1, 2)
        problems = xckpt.open(root + "/c").verify()
        p = root + "/c/xckpt.json"
        doc = json.loads(open(p, "rb").read())
        doc["world_size"] = 2 ** 62
        open(p, "wb").write(xckpt.manifest.manifest_bytes(doc))
        try:
            xckpt.open(root + "/c")
            hostile = "opened"
        except ManifestError as e:
            hostile = str(e)
        print(json.dumps({{"ok": ok, "problems": problems, "hostile": hostile}}))
        """
    )
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["problems"] == []
    assert "world_size must be an integer in [1," in out["hostile"]


# -- format version 2 and verify -------------------------------------------------------------


def _golden(version: int) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Load checked-in golden checkpoint ``v<version>``; every tensor (bit for bit) and JSON
    object is its expected.json's. Returns (root, expected, loaded)."""
    root = Path(__file__).parent / "golden" / f"v{version}"
    expect = json.loads((root / "expected.json").read_text())
    got = xckpt.load(root / "ckpt")
    for name, spec in expect["tensors"].items():
        arr = got[name]
        assert arr.dtype == xckpt.manifest.numpy_dtype(spec["dtype"]) and list(arr.shape) == spec["shape"]
        assert arr.tobytes().hex() == spec["hex"]
    for name, value in expect["objects"].items():
        assert got[name] == value
    assert xckpt.open(root / "ckpt").verify() == []
    return root, expect, got


def test_golden_v2_checkpoint_loads_unchanged():
    """A checkpoint written by format version 2 and checked in; never regenerated silently."""
    _root, expect, got = _golden(2)
    assert got["shape"] == tuple(expect["tagged_objects"]["shape"])
    assert got["blob"].hex() == expect["tagged_objects"]["blob_hex"]


def test_golden_v3_checkpoint_loads_unchanged():
    """Format version 3 (storage "files": one shard file c.0.0 per stored box), checked in;
    read directly and through tensorstore alike."""
    import tensorstore as ts

    root, _expect, got = _golden(3)
    ck = xckpt.open(root / "ckpt")
    assert ck.manifest.storage == {0: "files", 1: "files"}
    c = ck.info("w").chunks[1]
    assert sorted(p.name for p in (root / "ckpt" / c.key).iterdir()) == ["c.0.0", "zarr.json"]
    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{root / 'ckpt' / c.key}/"}).result()
    assert arr.read().result().tobytes() == got["w"][7:12].tobytes()
    m = json.loads((root / "ckpt" / "xckpt.json").read_text())
    assert m["version"] == 3 and m["storage"] == {"0": "files", "1": "files"}


def test_golden_v4_checkpoint_loads_unchanged():
    """Format version 4 (whole packed tensors written as rows), checked in."""
    root, _expect, got = _golden(4)
    m = json.loads((root / "ckpt" / "xckpt.json").read_text())
    assert m["version"] == 4 and m["packed"] == {"0": "data/0/packed"}
    assert m["tensors"]["scalar"][:4] == ["int64", [], 0, 20] and isinstance(m["tensors"]["w"], dict)
    ck = xckpt.open(root / "ckpt")
    assert ck.info("fp8").chunks[0].form == "packed" and ck.info("fp8").chunks[0].byte_offset == 12


def test_verify_is_about_as_fast_as_a_load(tmp_path):
    """One pass over each packed array: 2,000 small tensors verify in about a load's time."""
    d = {f"layer{i}.bias": np.full(512, i, np.float32) for i in range(2000)}
    d.update({f"w{i}": np.random.default_rng(i).standard_normal((400, 300)) for i in range(4)})
    xckpt.save(d, str(tmp_path / "c"))
    ck = xckpt.open(str(tmp_path / "c"))
    t = time.perf_counter()
    ck.read_all()
    t_load = time.perf_counter() - t
    ck = xckpt.open(str(tmp_path / "c"))
    t = time.perf_counter()
    assert ck.verify() == []
    t_verify = time.perf_counter() - t
    print(f"\nverify {t_verify:.3f} s, load {t_load:.3f} s ({len(d)} tensors)")
    assert t_verify < 3 * t_load + 0.3


def test_verify_names_each_damaged_tensor(tmp_path):
    d = {f"s{i}": np.full(64, i, np.float32) for i in range(50)}
    d["big"] = np.ones((400, 300), np.float32)
    xckpt.save(d, str(tmp_path / "c"), storage="plain")
    packed = next((tmp_path / "c" / "data" / "0" / "packed" / "c").rglob("*"))
    raw = bytearray(packed.read_bytes())
    raw[64 * 4 * 7 + 3] ^= 0xFF  # inside s7's bytes
    packed.write_bytes(bytes(raw))
    problems = xckpt.open(str(tmp_path / "c")).verify()
    assert len(problems) >= 1 and all("checkpoint" in p for p in problems)
    assert any("'s7'" in p for p in problems)
    assert not any("'big'" in p for p in problems)
    shutil.rmtree(tmp_path / "c" / "data" / "0" / "t")
    problems = xckpt.open(str(tmp_path / "c")).verify()
    assert any("'big'" in p for p in problems)
    with pytest.raises(CorruptChunkError, match="tensor 'big'"):
        xckpt.load(str(tmp_path / "c"))


def test_claimed_location_is_not_a_checkpoint(tmp_path):
    """A save in progress (or killed) has claimed the location: readers refuse it, and so
    does a second save without overwrite."""
    w = xckpt.Writer(str(tmp_path / "c"))
    w.write("t", np.ones((300, 300)))
    with pytest.raises(CheckpointNotFoundError, match=r"a save has claimed it .* not committed"):
        xckpt.open(str(tmp_path / "c"))
    with pytest.raises(CheckpointExistsError, match=r"claimed by save .* has not committed.*overwrite=True"):
        xckpt.save({"x": np.ones(3)}, str(tmp_path / "c"))
    w.commit()
    assert xckpt.load(str(tmp_path / "c"))["t"].sum() == 90000
