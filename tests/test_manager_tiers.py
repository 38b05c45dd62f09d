"""Checkpoint tiers (DESIGN.md section 11): local steps in per-node directories, replicated to
the other node, restored verified at 4, 3 and 2 ranks after saving at 4.

Real gloo ranks grouped into simulated nodes: 4 ranks with ``ranks_per_node=2`` are nodes
A (ranks 0, 1) and B (ranks 2, 3), each with a directory of its own as its local tier. A
node is lost by deleting its directory and running the next phase without its ranks (or
with a replaced node: an empty directory). Spawning is the expensive part, so the phases
run once (a module fixture) and each check is its own test, from what the ranks report:

1. 4 ranks save steps 1..8 (local every 2, persistent every 5);
2. 4 ranks restore with node A's copy of rank 0's part of step 8 damaged: the replica on
   node B serves; a byte flip in a replica is refused when it is the only copy;
3. node B is lost; 3 ranks (node A + a replaced node) restore step 6 (step 8's only
   intact copy of rank 0's part was on node B), train on, save step 8 at 3 ranks, and are
   SIGKILLed at a random point of step 10's local save and replication;
4. 2 ranks (node A + a replaced node) restore the newest local step left (8, or 10 when
   the kill came after it was complete), then a persistent step by number, then, with
   every local copy damaged, fall back to the persistent step.

Single-process tests cover the errors, one node's warning, numpy states and the
device-copy hook (the GPU path's logic on CPU).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from dist_utils import RankError, run_ranks

import xckpt
from xckpt.errors import XckptError
from xckpt.manager import CheckpointManager
from xckpt.manager._tiers import replica_pairs

ROWS = 256


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _shard(full: torch.Tensor, mesh, dim: int):
    """``full`` as a DTensor sharded on ``dim`` (torch.chunk's split, as Shard uses), built
    from this rank's slice without any collective."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    parts = full.chunk(world, dim)
    local = parts[rank] if rank < len(parts) else full.narrow(dim, 0, 0)
    return DTensor.from_local(local.contiguous(), mesh, [Shard(dim)], run_check=False, shape=full.shape,
                              stride=full.stride())


def _state(step: int, mesh) -> dict:
    """The training state at ``step``: a Shard(0) float32 DTensor, a Shard(1) bf16 DTensor,
    a plain (replicated) tensor and the step; the same whatever the world size."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(ROWS, 512, generator=g)
    e = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    b = torch.randn(33, generator=g)
    return {"w": _shard(w, mesh, 0), "e": _shard(e, mesh, 1), "b": b, "step": step}


def _blank(mesh) -> dict:
    s = _state(0, mesh)
    for k in ("w", "e", "b"):
        (s[k].to_local() if hasattr(s[k], "to_local") else s[k]).zero_()
    s["step"] = -1
    return s


def _same(got: dict, want: dict) -> bool:
    """Every element bit for bit (bf16 as its bits)."""
    for k in ("w", "e", "b"):
        a, b = got[k], want[k]
        a = a.to_local() if hasattr(a, "to_local") else a
        b = b.to_local() if hasattr(b, "to_local") else b
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not torch.equal(a.contiguous().view(torch.int16 if a.dtype == torch.bfloat16 else a.dtype),
                           b.contiguous().view(torch.int16 if b.dtype == torch.bfloat16 else b.dtype)):
            return False
    return got["step"] == want["step"]


def _restore(m: CheckpointManager, mesh, **kw) -> tuple[int, bool, list[str]]:
    """Restore into a blank state: (the step restored, bit-exact, the warnings)."""
    target = _blank(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.restore(target, **kw)
    step = int(target["step"])
    return step, _same(target, _state(step, mesh)), [str(w.message) for w in caught]


def _manager(root: str, local: str, **kw) -> CheckpointManager:
    opts = dict(local_every=2, save_every=5, local_keep=2, replicas=1, ranks_per_node=2, handle_preemption=False)
    opts.update(kw)
    return CheckpointManager(root, local=local, **opts)


def _node_dir(base: str, rank: int, rpn: int, names: list[str]) -> str:
    return os.path.join(base, names[rank // rpn])


def _phase_save(rank: int, world: int, base: str) -> dict:
    mesh = _mesh(world)
    local = _node_dir(base, rank, 2, ["A", "B"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = _manager(os.path.join(base, "root"), local)
        for step in range(1, 9):
            saved = m.save(step, _state(step, mesh))
            assert saved == (step % 5 == 0)
        m.wait()
        out = {"local": m.local_steps(), "steps": m.steps(), "warnings": [str(w.message) for w in caught]}
    out["files"] = sorted(os.listdir(os.path.join(local, "8", "ranks")))
    out["restored"] = _restore(m, mesh)
    m.close()
    return out


def _flip(path: str) -> None:
    """Flip one byte in the middle of the largest file under ``path``."""
    files = [os.path.join(b, f) for b, _d, fs in os.walk(path) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as fh:
        fh.seek(os.path.getsize(big) // 2)
        c = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([c[0] ^ 0x40]))


def _data_of(step_dir: str, rank: int) -> str:
    return next(os.path.join(step_dir, "data", d) for d in os.listdir(os.path.join(step_dir, "data"))
                if d.split(".")[0] == str(rank))


def _phase_damaged_primary(rank: int, world: int, base: str) -> dict:
    mesh = _mesh(world)
    if rank == 0:
        _flip(_data_of(os.path.join(base, "A", "8"), 0))  # node A's own copy of rank 0's part
    torch.distributed.barrier()
    m = _manager(os.path.join(base, "root"), _node_dir(base, rank, 2, ["A", "B"]))
    out = {"restored": _restore(m, mesh)}
    m.close()
    return out


def _phase_three(rank: int, world: int, base: str, frac: float) -> dict:
    """Node B lost (its directory deleted by the test), node A + a replaced node C."""
    mesh = _mesh(world)
    m = _manager(os.path.join(base, "root"), _node_dir(base, rank, 2, ["A", "C"]), save_every=100)
    out = {"restored": _restore(m, mesh)}
    step = out["restored"][0]
    for s in range(step + 1, 9):
        m.save(s, _state(s, mesh))
    t0 = time.monotonic()
    m.wait()
    took = [time.monotonic() - t0]
    torch.distributed.broadcast_object_list(took, group_src=0)
    out["local"] = m.local_steps()
    with open(os.path.join(base, f"three-{rank}.json"), "w") as fh:
        json.dump(out, fh)  # this phase is killed below: what it found goes through a file
    # step 10's local save and replication, killed part way (every rank at once)
    m.save(9, _state(9, mesh))
    torch.distributed.barrier()
    threading.Timer(frac * max(took[0], 0.05), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    m.save(10, _state(10, mesh))
    m.wait()
    time.sleep(30)  # the kill comes
    return out


def _phase_two(rank: int, world: int, base: str) -> dict:
    mesh = _mesh(world)
    m = _manager(os.path.join(base, "root"), _node_dir(base, rank, 1, ["A", "D"]), ranks_per_node=1)
    out = {"restored": _restore(m, mesh), "persistent": _restore(m, mesh, step=5)}
    if rank == 0:
        for s in os.listdir(os.path.join(base, "A")):
            for d in os.listdir(os.path.join(base, "A", s, "data")):
                _flip(os.path.join(base, "A", s, "data", d))
    torch.distributed.barrier()
    out["fallback"] = _restore(m, mesh)
    m.close()
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("tiers"))
    out = {"base": base}
    out["save"] = run_ranks(_phase_save, 4, base, timeout=120)
    from xckpt.cli import main

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ls", os.path.join(base, "root")])
    out["ls"] = buf.getvalue()
    out["damaged"] = run_ranks(_phase_damaged_primary, 4, base, timeout=120)
    shutil.rmtree(os.path.join(base, "B"))  # node B is lost
    frac = random.Random().uniform(0.0, 1.2)
    out["frac"] = frac
    try:
        run_ranks(_phase_three, 3, base, frac, timeout=120)
    except RankError as e:
        out["killed"] = str(e)
    out["two"] = run_ranks(_phase_two, 2, base, timeout=120)
    return out


def test_saves_local_steps_replicated_to_the_other_node(phases):
    r = phases["save"]
    assert all(x["local"] == [6, 8] and x["steps"] == [5] for x in r)
    # each node holds its own ranks' parts and the other node's: all four
    assert all(x["files"] == ["0.json", "1.json", "2.json", "3.json"] for x in r)
    assert sorted(os.listdir(os.path.join(phases["base"], "A"))) == ["6", "8"]  # local_keep=2
    assert all(x["restored"][:2] == (8, True) for x in r)
    assert not any(x["warnings"] for x in r)


def test_ls_says_where_local_steps_are(phases):
    text = phases["ls"]
    assert "local steps: every 2 steps on 2 nodes" in text
    assert os.path.join(phases["base"], "A") in text and os.path.join(phases["base"], "B") in text
    assert "latest 8" in text


def test_an_intact_replica_serves_beside_a_damaged_primary(phases):
    r = phases["damaged"]
    assert all(x["restored"][:2] == (8, True) for x in r)
    said = [w for x in r for w in x["restored"][2]]
    assert any("local step 8" in w and "rank 0's part" in w and "check" in w for w in said), said


def test_restart_at_three_ranks_falls_back_to_the_next_local_step(phases):
    """Node A's copy of rank 0's part of step 8 is damaged and node B (the replica) is gone:
    step 8 is passed over with a warning, step 6 restored at 3 ranks; then the ranks were
    SIGKILLed during step 10's local save."""
    assert "died without a result" in phases.get("killed", ""), phases.get("killed")
    r = [json.load(open(os.path.join(phases["base"], f"three-{k}.json"))) for k in range(3)]
    assert all(x["restored"][:2] == [6, True] for x in r)
    said = [w for x in r for w in x["restored"][2]]
    assert any("local step 8 is passed over" in w and "[0]" in w for w in said), said
    assert all(x["local"] == [6, 8] for x in r)


def test_restart_at_two_ranks_restores_the_newest_local_step_left(phases):
    r = phases["two"]
    steps = {x["restored"][0] for x in r}
    assert len(steps) == 1 and steps <= {8, 10}, (phases["frac"], steps)
    assert all(x["restored"][1] for x in r)


def test_restore_step_looks_in_the_persistent_root(phases):
    assert all(x["persistent"][:2] == (5, True) for x in phases["two"])


def test_every_local_copy_damaged_falls_back_to_persistent(phases):
    r = phases["two"]
    assert all(x["fallback"][:2] == (5, True) for x in r)
    said = [w for x in r for w in x["fallback"][2]]
    assert any("passed over" in w for w in said), said
