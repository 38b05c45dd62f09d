"""xckpt.torch modes and errors on real gloo ranks: async save, rank-local saves with no
collective, structure changes between saves, and every error path.

One 2-rank spawn runs all scenarios (spawning dominates the cost) and reports
per scenario; each scenario is its own test id.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from dist_utils import run_ranks

COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "new_group", "batch_isend_irecv",
)


class CollectiveCounter:
    """Counts calls of every torch.distributed collective while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: list = []

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for mod in (dist, c10d):
            for name in COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is None:
                    continue

                def wrapped(*a, __fn=fn, __name=name, **k):
                    self.calls.append(__name)
                    return __fn(*a, **k)

                self._saved.append((mod, name, fn))
                setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)


def _dt(shape, placements, local=None, seed=0):
    """A DTensor on the 2-rank world mesh cut from a seeded full tensor."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return distribute_tensor(full, init_device_mesh("cpu", (2,)), placements), full


def _err(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # the parent test checks type and message
        return type(e).__name__, str(e)
    return None


def _modes_rank(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    import xckpt.torch as xt

    out: dict = {}
    p = lambda name: os.path.join(root, name)  # noqa: E731

    # -- async save overlapped with an update ---------------------------------
    w, w_full = _dt((64, 8), [Shard(0)], seed=1)
    plain = torch.arange(10.0)
    sd = {"w": w, "p": plain, "step": 1}
    before = {"w": w_full.clone(), "p": plain.clone()}
    fut = xt.save(sd, p("async"), async_save=True)
    w.to_local().add_(1000.0)
    plain.add_(1000.0)
    manifest = fut.result(timeout=60)
    # The future resolves to this rank's manifest, as a sync save returns it.
    out["async_returns_manifest"] = (
        None
        if (manifest.rank, manifest.world_size, sorted(manifest.tensors)) == (rank, 2, ["p", "w"])
        and fut.done()
        else f"future resolved to {manifest!r:.200}"
    )
    sync = xt.save({"x": torch.ones(2)}, p("sync_manifest"))
    out["sync_returns_manifest"] = None if list(sync.tensors) == ["x"] else f"sync save returned {sync!r:.200}"
    got = xt.load_full(p("async"))
    out["async_overlap"] = (
        None
        if torch.equal(got["w"], before["w"]) and torch.equal(got["p"], before["p"]) and got["step"] == 1
        else "checkpoint does not hold the values from before the update"
    )
    fut2 = xt.save({"x": torch.ones(3)}, p("async2"), async_save=True)
    xt.save({"x": torch.zeros(3)}, p("sync3"))
    out["async_second_waits"] = None if fut2.done() else "second save did not wait for the first"
    fut2.result()

    # -- structure changes between saves -----------------------------------------
    a, _ = _dt((6, 4), [Shard(0)], seed=2)
    xt.save({"a": a}, p("struct"))
    b, _ = _dt((5, 3), [Replicate()], seed=3)
    sd2 = {"a": a, "b": b, "note": "new"}
    xt.save(sd2, p("struct"), overwrite=True)
    xt.save(sd2, p("struct2"))
    names = [sorted(xt.load_full(p(x))) for x in ("struct", "struct2")]
    out["structure_change"] = None if names == [["a", "b", "note"]] * 2 else f"names {names}"

    # -- rank-local save: no collective, peers never wait for each other ----------
    t, t_full = _dt((9, 5), [Shard(0)], seed=4)
    rl_sd = {"t": t, "r": torch.arange(4), "obj": {"k": 1}, "mine": xt.PerRank(rank)}
    flag = p(f"rank{rank}.saved")
    if rank == 1:  # rank 1 saves only after rank 0 has finished: a collective would hang
        while not os.path.exists(p("rank0.saved")):
            time.sleep(0.05)
    with CollectiveCounter() as c:
        xt.save(rl_sd, p("local"), rank_local=True)
    open(flag, "w").close()
    out["rank_local_no_collectives"] = None if not c.calls else f"collectives called: {c.calls}"
    if rank == 0:
        while not os.path.exists(p("rank1.saved")):
            time.sleep(0.05)
    tgt, _ = _dt((9, 5), [Replicate()], seed=99)
    tgt_sd = {"t": tgt, "r": torch.zeros(4, dtype=torch.int64), "obj": None, "mine": xt.PerRank()}
    with CollectiveCounter() as c:
        xt.load(p("local"), tgt_sd)
    ok = torch.equal(tgt.to_local(), t_full) and tgt_sd["mine"] == xt.PerRank(rank) and tgt_sd["obj"] == {"k": 1}
    out["load_no_collectives"] = f"collectives called: {c.calls}" if c.calls else (None if ok else "wrong values")

    # -- errors ---------------------------------------------------------------------
    mesh = w.device_mesh
    part = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()], run_check=False)
    out["err_partial_save"] = _err(lambda: xt.save({"layers.0.part": part}, p("partial")))
    out["err_partial_load"] = _err(lambda: xt.load(p("async"), {"w": DTensor.from_local(torch.ones(64, 8), mesh, [Partial()])}))
    rows = 4 if rank == 0 else 3  # rank 1 claims a shard that Shard(0) of 8 rows never gives
    bad = DTensor.from_local(torch.ones(rows, 2), mesh, [Shard(0)], run_check=False, shape=torch.Size((8, 2)), stride=(2, 1))
    out["err_bad_local_shape"] = _err(lambda: xt.save({"bad": bad}, p("bad")))
    out["err_shape_mismatch"] = _err(lambda: xt.load(p("async"), {"w": _dt((64, 9), [Shard(1)])[0]}))
    out["err_dtype_mismatch"] = _err(
        lambda: xt.load(p("async"), {"w": DTensor.from_local(torch.zeros(32, 8, dtype=torch.float64), mesh, [Shard(0)])})
    )
    out["err_missing_strict"] = _err(lambda: xt.load(p("async"), {"w": w, "nope": torch.zeros(1)}))
    res = xt.load(p("async"), {"p": torch.zeros(10), "nope": torch.zeros(1)}, strict=False)
    out["missing_unexpected_reported"] = (
        None if (res.missing, sorted(res.unexpected)) == (["nope"], ["step", "w"]) else repr(res)
    )
    out["err_exists"] = _err(lambda: xt.save({"x": torch.ones(1)}, p("sync3")))
    out["err_object_into_tensor"] = _err(lambda: xt.load(p("async"), {"step": torch.zeros(1)}))
    dist.barrier()
    return out


def _noinit_rank(rank: int, world: int, root: str) -> dict:
    """No process group at all: a rank-local checkpoint still loads, with no collective."""
    import torch
    import torch.distributed as dist

    import xckpt.torch as xt

    out: dict = {}
    path = os.path.join(root, "local")
    sd = {"t": torch.zeros(9, 5), "r": torch.zeros(4, dtype=torch.int64), "obj": None, "mine": xt.PerRank(all_ranks=True)}
    xt.load(path, sd)
    full = torch.randn((9, 5), generator=torch.Generator().manual_seed(4))
    ok = torch.equal(sd["t"], full) and torch.equal(sd["r"], torch.arange(4)) and sd["obj"] == {"k": 1}
    ok = ok and sd["mine"].value == [0, 1] and not dist.is_initialized()
    out["noinit_load"] = None if ok else f"wrong values {sd}"
    out["err_per_rank_other_world"] = _err(lambda: xt.load(path, {"mine": None}))
    return out


@pytest.fixture(scope="module")
def modes(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("torch_modes"))
    results: dict = {}
    for per_rank in run_ranks(_modes_rank, 2, root, timeout=180):
        for k, v in per_rank.items():
            results.setdefault(k, []).append(v)
    for per_rank in run_ranks(_noinit_rank, 2, root, init=False, timeout=120):
        for k, v in per_rank.items():
            results.setdefault(k, []).append(v)
    return results


@pytest.mark.parametrize(
    "scenario",
    [
        "async_overlap",
        "async_second_waits",
        "async_returns_manifest",
        "sync_returns_manifest",
        "structure_change",
        "rank_local_no_collectives",
        "load_no_collectives",
        "missing_unexpected_reported",
        "noinit_load",
    ],
)
def test_mode(modes, scenario):
    assert modes[scenario] == [None, None]


ERRORS = {
    "err_partial_save": ("UnsupportedPlacementError", r"tensor 'layers\.0\.part' has a Partial placement .*redistribute"),
    "err_partial_load": ("UnsupportedPlacementError", r"tensor 'w' has a Partial placement"),
    "err_shape_mismatch": ("ShapeMismatchError", r"checkpoint '.*async', tensor 'w': saved with global shape \(64, 8\), the target has global shape \(64, 9\)"),
    "err_dtype_mismatch": ("DtypeMismatchError", r"checkpoint '.*async', tensor 'w': saved as float32, the target is float64; load into a float32 tensor"),
    "err_missing_strict": ("MissingEntryError", r"checkpoint '.*async' lacks 1 requested entries: \['nope'\]\. Load with strict=False"),
    "err_exists": ("CheckpointExistsError", r"already holds a save .* pass overwrite=True"),
    "err_object_into_tensor": ("ObjectError", r"'step' is saved as an object, but the target is a tensor"),
    "err_per_rank_other_world": ("ObjectError", r"object 'mine' was saved per rank by 2 ranks and is loaded at world size 1.*PerRank\(all_ranks=True\)"),
}


@pytest.mark.parametrize("scenario", list(ERRORS))
def test_error(modes, scenario):
    kind, pattern = ERRORS[scenario]
    for got in modes[scenario]:
        assert got is not None, f"{scenario}: no error raised"
        assert got[0] == kind, got
        assert re.search(pattern, got[1]), got[1]


def test_error_on_one_rank_fails_every_rank(modes):
    """Rank 1's local shard fits no layout: it raises LayoutError, rank 0 learns of it."""
    r0, r1 = modes["err_bad_local_shape"]
    assert r1[0] == "LayoutError"
    assert re.search(r"tensor 'bad': the local shard at mesh coordinate \(1,\) has shape \(3, 2\), but placements \['Shard\(0\)'\] on mesh \(2,\) give \(4, 2\)", r1[1]), r1[1]
    assert r0[0] == "XckptError"
    assert re.search(r"save to '.*bad' failed on ranks \[1\]: rank 1: LayoutError: tensor 'bad'", r0[1]), r0[1]
