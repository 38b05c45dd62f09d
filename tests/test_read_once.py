"""``xckpt.torch.load(..., read_once=True)``: each stored range read by one rank, sent to the others.

The plan (pure, no torch) is checked in tests/test_sharing.py. Real gloo ranks (2 and 4, one spawn each)
then load replicated targets, 2 x 2 data-parallel x tensor-parallel DTensors on a
2-D mesh, uneven and empty shards, bfloat16, bit for bit, counting the bytes each
rank reads from its chunk files; and fail together: a corrupt chunk only one rank
reads, a corrupt chunk every rank needs, a target that does not fit on one rank, a
planner that fails, and a rank that never calls ``load`` (the others time out instead
of hanging).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

import xckpt
import xckpt.torch as xt

# -- real ranks ---------------------------------------------------------------------------------


def _data(shape, dtype, seed):
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


#: name -> (shape, dtype, placements on a (dp=2, tp=2) mesh, placements on a 1-D mesh of 2)
TENSORS = {
    "w_rows": ((600, 700), torch.float32, "R,S0", "S0"),  # 1.6 MiB: 2 zarr chunks of rows
    "w_cols": ((520, 1030), torch.bfloat16, "R,S1", "S1"),  # columns: TP ranks share zarr chunks
    "emb": ((301, 77), torch.int64, "R,S0", "R"),
    "bias": ((13,), torch.float32, "R,S0", "S0"),  # uneven: 7 and 6
    "odd": ((5, 3), torch.bfloat16, "R,S0", "S0"),  # uneven: 3 and 2
    "thin": ((1, 9), torch.float32, "R,S0", "S0"),  # an empty shard
    "empty": ((0, 8), torch.float32, "R,S0", "R"),
    "scalar": ((), torch.float32, "plain", "plain"),
}
CASE_BYTES = sum(
    int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d, _a, _b in TENSORS.values()
)


def _placements(text):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in text.split(",")]


def _state(layout, mesh, fill):
    """The state dict: ``layout`` "plain" (whole tensors), "2d" or "1d" (DTensors)."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for i, (name, (shape, dtype, p2, p1)) in enumerate(TENSORS.items()):
        full = _data(shape, dtype, i) if fill else torch.zeros(shape, dtype=dtype)
        pl = p2 if layout == "2d" else p1
        out[name] = (
            full if layout == "plain" or pl == "plain" else distribute_tensor(full, mesh, _placements(pl))
        )
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bits(t):
    t = _local(t).contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


def _load(path, target, **kw):
    """(bytes read from chunk files, error or None)."""
    from xckpt.native import _fileio

    before = _fileio.bytes_read()
    try:
        xt.load(path, target, **kw)
    except Exception as e:
        return _fileio.bytes_read() - before, (type(e).__name__, str(e))
    return _fileio.bytes_read() - before, None


def _check(path, layout, mesh, **kw):
    target, want = _state(layout, mesh, False), _state(layout, mesh, True)
    nbytes, err = _load(path, target, **kw)
    wrong = [n for n in TENSORS if _bits(target[n]) != _bits(want[n])]
    return {"bytes": nbytes, "error": err, "wrong": wrong}


def _failing_plan(*args, **kwargs):
    from xckpt.errors import XckptError

    raise XckptError("read_once: no rank holds ['w_rows']")


def _blocking_copy(dst, src):
    dst.copy_(src)


def _four(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import xckpt.torch._read_once as ro
    from xckpt.torch._pipeline import DeviceRing

    ro.TIMEOUT_S = 20
    path = os.path.join(root, "ckpt")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {
        "replicated": _check(path, "plain", mesh, read_once=True),
        "replicated_baseline": _check(path, "plain", mesh),
        "dp_tp": _check(path, "2d", mesh, read_once=True),
        "dp_tp_baseline": _check(path, "2d", mesh),
    }
    # a checkpoint written by 4 ranks (4 chunks a tensor), loaded whole by every rank in
    # many small rounds, through a ring with a copy hook (the device path, on CPU)
    xt.save(_state("2d", mesh, True), os.path.join(root, "w4"))
    ro.ROUND_BYTES = 256 << 10
    ring = DeviceRing(2, 64 << 10, copy=_blocking_copy)
    out["rounds"] = _check(os.path.join(root, "w4"), "plain", mesh, read_once=True, ring=ring)
    # the same through requests longer than the first exchange carries (a second one brings the rest)
    ro.GATHER_HEAD = 40
    out["long_requests"] = _check(os.path.join(root, "w4"), "plain", mesh, read_once=True)
    ro.GATHER_HEAD = 64 << 10
    # a plan longer than the first broadcast carries (a second one brings the rest)
    ro.PLAN_HEAD = 40
    out["long_plan"] = _check(os.path.join(root, "w4"), "plain", mesh, read_once=True)
    ro.PLAN_HEAD = 256 << 10
    ro.ROUND_BYTES = 256 << 20
    # the planner fails (here: its planning raises): every rank raises, none waits
    plan = ro.make_plan
    if rank == 0:
        ro.make_plan = _failing_plan
    out["planner_fails"] = _load(path, _state("plain", mesh, False), read_once=True)[1]
    ro.make_plan = plan
    # two process groups of 2 ranks, each loading on its own (group ranks != global ranks)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out["subgroup"] = _check(path, "plain", mesh, read_once=True, process_group=groups[rank // 2])
    dist.barrier()
    bad = os.path.join(root, "bad")
    # "solo": Shard(0) rows, each rank alone reads its zarr chunk; rank 2's is corrupt
    solo = {
        "solo": torch.distributed.tensor.distribute_tensor(
            torch.zeros(1024, 1024), init_device_mesh("cpu", (4,)), _placements("S0")
        )
    }
    out["corrupt_solo"] = _load(bad, solo, read_once=True, strict=False)[1]
    # "shared": every rank needs it; whoever reads the corrupt zarr chunk fails
    out["corrupt_shared"] = _load(bad, {"shared": torch.zeros(1024, 1024)}, read_once=True, strict=False)[1]
    # the same in rounds of 256 KiB: the failed reader sends zeros for the rounds left, every rank fails at the end
    ro.ROUND_BYTES = 256 << 10
    out["corrupt_rounds"] = _load(bad, {"shared": torch.zeros(1024, 1024)}, read_once=True, strict=False)[1]
    ro.ROUND_BYTES = 256 << 20
    # a target that does not fit, on rank 1 only
    shape = (3, 3) if rank == 1 else (600, 700)
    out["bad_target"] = _load(path, {"w_rows": torch.zeros(shape)}, read_once=True, strict=False)[1]
    # rank 3 opens another checkpoint
    other, tgt = (
        (bad, {"shared": torch.zeros(1024, 1024)}) if rank == 3 else (path, {"w_rows": torch.zeros(600, 700)})
    )
    out["other_ckpt"] = _load(other, tgt, read_once=True, strict=False)[1]
    # the group still works after those failures
    out["after"] = _check(path, "plain", mesh, read_once=True)
    # rank 3 never calls load: the others give up after TIMEOUT_S (the group is unusable then)
    ro.TIMEOUT_S = 3
    if rank != 3:
        out["stopped"] = _load(path, _state("plain", mesh, False), read_once=True)[1]
    return out


def _two(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    path = os.path.join(root, "ckpt")
    mesh = init_device_mesh("cpu", (2,))
    return {
        "replicated": _check(path, "plain", mesh, read_once=True),
        "replicated_baseline": _check(path, "plain", mesh),
        "mesh_1d": _check(path, "1d", mesh, read_once=True),
        "mesh_1d_baseline": _check(path, "1d", mesh),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("read_once"))
    xt.save(
        {n: _data(s, d, i) for i, (n, (s, d, _a, _b)) in enumerate(TENSORS.items())},
        os.path.join(root, "ckpt"),
    )
    bad = os.path.join(root, "bad")
    xt.save(
        {
            "solo": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024),
            "shared": torch.ones(1024, 1024),
        },
        bad,
    )
    ck = xckpt.open(bad)
    for name, idx in (("solo", 2), ("shared", 1)):  # zarr chunks of 256 rows
        assert ck.info(name).chunks[0].grid == (256, 1024)
        (f,) = glob.glob(os.path.join(bad, ck.info(name).chunks[0].key, "c.*"))
        with open(f, "r+b") as fh:  # a "files" shard: an index of (offset, nbytes) per zarr chunk
            index = np.frombuffer(fh.read(16 * 4), "<u8").reshape(4, 2)
            fh.seek(int(index[idx, 0]) + 100)
            b = fh.read(1)
            fh.seek(int(index[idx, 0]) + 100)
            fh.write(bytes([b[0] ^ 0x55]))
    return root


@pytest.fixture(scope="module")
def four(saved):
    return run_ranks(_four, 4, saved, timeout=150)


@pytest.fixture(scope="module")
def two(saved):
    return run_ranks(_two, 2, saved, timeout=90)


def _ok(results, case):
    for r, res in enumerate(results):
        assert res[case]["error"] is None, f"rank {r}: {res[case]['error']}"
        assert res[case]["wrong"] == [], f"rank {r}: {res[case]['wrong']} differ"


@pytest.mark.parametrize(
    "case", ["replicated", "dp_tp", "rounds", "long_requests", "long_plan", "subgroup", "after"]
)
def test_four_ranks_bit_exact(four, case):
    _ok(four, case)


def test_each_subgroup_reads_one_copy(four):
    for ranks in ((0, 1), (2, 3)):
        assert sum(four[r]["subgroup"]["bytes"] for r in ranks) <= 1.15 * CASE_BYTES


@pytest.mark.parametrize("case", ["replicated", "mesh_1d"])
def test_two_ranks_bit_exact(two, case):
    _ok(two, case)


@pytest.mark.parametrize("ranks,case", [(4, "replicated"), (4, "dp_tp"), (2, "replicated"), (2, "mesh_1d")])
def test_storage_serves_about_one_copy(four, two, ranks, case):
    results = four if ranks == 4 else two
    once = sum(r[case]["bytes"] for r in results)
    plain = sum(r[f"{case}_baseline"]["bytes"] for r in results)
    assert once <= 1.15 * CASE_BYTES, f"read_once read {once / CASE_BYTES:.2f}x the checkpoint"
    # without read_once each replica reads its own copy
    assert plain >= (ranks if case == "replicated" else 1.5) * 0.95 * CASE_BYTES


def test_corrupt_chunk_only_one_rank_reads_fails_every_rank(four):
    errs = [r["corrupt_solo"] for r in four]
    assert all(e is not None for e in errs)
    assert errs[2][0] == "CorruptChunkError" and "'solo'" in errs[2][1]
    for r in (0, 1, 3):
        kind, msg = errs[r]
        assert kind == "XckptError" and "failed on ranks [2]" in msg and "CorruptChunkError" in msg, msg


@pytest.mark.parametrize("case", ["corrupt_shared", "corrupt_rounds"])
def test_corrupt_chunk_every_rank_needs_fails_every_rank(four, case):
    errs = [r[case] for r in four]
    kinds = sorted(e[0] for e in errs)
    assert kinds == ["CorruptChunkError"] + ["XckptError"] * 3, errs
    assert all("'shared'" in e[1] for e in errs)


def test_a_target_that_does_not_fit_on_one_rank_fails_every_rank(four):
    errs = [r["bad_target"] for r in four]
    assert errs[1][0] == "ShapeMismatchError"
    for r in (0, 2, 3):
        assert errs[r][0] == "XckptError" and "failed on ranks [1]" in errs[r][1] and "w_rows" in errs[r][1]


def test_a_planner_that_fails_fails_every_rank(four):
    kind, msg = four[0]["planner_fails"]
    assert kind == "XckptError" and "no rank holds ['w_rows']" in msg, msg
    for r in (1, 2, 3):
        kind, msg = four[r]["planner_fails"]
        assert kind == "XckptError" and "rank 0 could not plan the load" in msg and "no rank holds" in msg, msg


def test_ranks_that_open_different_checkpoints_all_raise(four):
    for r in range(4):
        kind, msg = four[r]["other_ckpt"]
        assert kind == "XckptError" and "opened different checkpoints" in msg and "[[0, 1, 2], [3]]" in msg, (
            msg
        )


def test_a_rank_that_never_loads_makes_the_others_raise_not_hang(four):
    for r in (0, 1, 2):
        kind, msg = four[r]["stopped"]
        assert kind == "XckptError" and "another rank stopped" in msg, msg
    assert "stopped" not in four[3]


def test_read_once_alone_reads_as_without(tmp_path):
    """No process group (or a group of one): read_once changes nothing."""
    sd = {"a": _data((40, 30), torch.bfloat16, 1)}
    xt.save(sd, str(tmp_path / "c"))
    target = {"a": torch.zeros(40, 30, dtype=torch.bfloat16)}
    xt.load(str(tmp_path / "c"), target, read_once=True)
    assert _bits(target["a"]) == _bits(sd["a"])


def _cuda_ranks(rank, world, root):

    path = os.path.join(root, "ckpt")
    target = {n: t.cuda() for n, t in _state("plain", None, False).items()}
    nbytes, err = _load(path, target, read_once=True)
    want = _state("plain", None, True)
    return {
        "error": err,
        "wrong": [n for n in TENSORS if _bits(target[n].cpu()) != _bits(want[n])],
        "bytes": nbytes,
    }


@pytest.mark.gpu
def test_two_ranks_onto_one_gpu(saved):
    """gloo ranks sharing the GPU: received ranges reach CUDA targets through the side stream."""
    results = run_ranks(_cuda_ranks, 2, saved, timeout=120)
    for r, res in enumerate(results):
        assert res["error"] is None and res["wrong"] == [], (r, res)
    assert sum(r["bytes"] for r in results) <= 1.15 * CASE_BYTES
