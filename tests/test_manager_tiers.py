"""Checkpoint tiers (DESIGN.md section 11): local steps in per-node directories, replicated to
the other node, restored verified at 4, 3 and 2 ranks after saving at 4.

Real gloo ranks grouped into simulated nodes: 4 ranks with ``ranks_per_node=2`` are nodes
A (ranks 0, 1) and B (ranks 2, 3), each with a directory of its own as its local tier. A
node is lost by deleting its directory and running the next phase without its ranks (or
with a replaced node: an empty directory). Spawning is the expensive part, so the phases
run once (a module fixture) and each check is its own test, from what the ranks report:

1. 4 ranks save steps 1..8 (local every 2, persistent every 5), restore step 8, then
   restore it again with node A's copy of rank 0's part damaged: node B's replica serves;
2. node B is lost; 3 ranks (node A + a replaced node) restore step 6 (step 8's only
   intact copy of rank 0's part was on node B), train on, save step 8 at 3 ranks, and are
   SIGKILLed at a random point of step 10's local save and replication;
3. 2 ranks (node A + a replaced node) restore the newest local step left (8, or 10 when
   the kill came after it was complete), then a persistent step by number, then, with
   every local copy damaged, fall back to the persistent step.

Single-process tests cover the errors, one node's warning, numpy states and the
device-copy hook (the GPU path's logic on CPU).
"""

from __future__ import annotations

import contextlib
import io
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
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.cli import main
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.manager import CheckpointManager
from xckpt.manager._tiers import replica_pairs
from xckpt.manifest import manifest_bytes

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


def _small_messages() -> None:
    """Replicate files of 16 KiB or more in 48 KiB messages (the path of a large state's files:
    sent from a mapping, received in chunks), so the ranks' 128 KiB parts take it."""
    import xckpt.manager._replicate as rep

    rep.MAP_AT, rep.CHUNK = 16 << 10, 48 << 10


def _phase_save(rank: int, world: int, base: str) -> dict:
    _small_messages()
    mesh = _mesh(world)
    local = _node_dir(base, rank, 2, ["A", "B"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = _manager(os.path.join(base, "root"), local)
        inodes = {}  # each local step's own data files (name -> inode), once its round is done
        for step in range(1, 9):
            saved = m.save(step, _state(step, mesh))
            assert saved == (step % 5 == 0)
            m.wait()
            own = os.path.join(local, str(step), "data", str(rank))
            if step % 2 == 0:
                inodes[step] = {os.path.relpath(os.path.join(b, n), own): os.stat(os.path.join(b, n)).st_ino
                                for b, _d, ns in os.walk(own) for n in ns if n.startswith("c.")}
        out = {"local": m.local_steps(), "steps": m.steps(), "warnings": [str(w.message) for w in caught]}
    out["inodes"] = [sorted(inodes[s].items()) for s in (2, 4, 6, 8)]
    torch.distributed.barrier()  # the node's other rank has released its part of step 4 too
    out["files"] = sorted(os.listdir(os.path.join(local, "8", "ranks")))
    out["dirs"] = sorted(os.listdir(local))
    out["reused"] = m._tiers.rep.reused_bytes  # step 8's replica, received into step 2's spares
    spares = os.path.join(local, ".spare")
    out["spares"] = sorted(os.path.relpath(os.path.join(b, n), spares) for b, _d, ns in os.walk(spares) for n in ns)
    out["restored"] = _restore(m, mesh)
    # node A's own copy of rank 0's part of step 8 damaged: node B's replica serves
    if rank == 0:
        _flip(_data_of(os.path.join(base, "A", "8"), 0))
    torch.distributed.barrier()
    out["damaged"] = _restore(m, mesh)
    out["merged"] = sorted(s for s in os.listdir(local) if os.path.exists(os.path.join(local, s, "xckpt.json")))
    # node A's merged manifest of step 8 damaged too: the rank manifests are merged instead
    torch.distributed.barrier()
    if rank == 0:
        _flip_digit(os.path.join(base, "A", "8", "xckpt.json"))
    torch.distributed.barrier()
    out["merged_damaged"] = _restore(m, mesh)
    # node A's copy of rank 1's manifest of step 8 made invalid under a valid checksum (what a
    # faulty writer could do, no damage can): the listing reads its header only, the merge
    # finds it, and node B's copy serves; then put back for the phases below
    torch.distributed.barrier()
    bad = os.path.join(base, "A", "8", "ranks", "1.json")
    if rank == 0:
        with open(bad, "rb") as fh:
            kept = fh.read()
        doc = json.loads(kept)
        doc["tensors"]["bogus"] = {"dtype": "float32", "shape": [4], "chunks": 7}
        with open(bad, "wb") as fh:
            fh.write(manifest_bytes(doc))
    torch.distributed.barrier()
    out["rank_manifest_invalid"] = _restore(m, mesh)
    torch.distributed.barrier()
    if rank == 0:
        with open(bad, "wb") as fh:
            fh.write(kept)
    m.close()
    torch.distributed.barrier()
    out["closed"] = sorted(os.listdir(local))
    return out


def _flip_digit(path: str) -> None:
    """Change one digit in the middle of a JSON file (still JSON, the checksum no longer matches)."""
    with open(path, "r+b") as fh:
        data = bytearray(fh.read())
        i = next(i for i in range(len(data) // 2, len(data)) if chr(data[i]).isdigit())
        data[i] = ord("1") if data[i] != ord("1") else ord("2")
        fh.seek(0)
        fh.write(data)


def _flip(path: str) -> None:
    """Flip one byte in the middle of the largest file under ``path``."""
    files = [path] if os.path.isfile(path) else [os.path.join(b, f) for b, _d, fs in os.walk(path) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as fh:
        fh.seek(os.path.getsize(big) // 2)
        c = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([c[0] ^ 0x40]))


def _data_of(step_dir: str, rank: int) -> str:
    return next(os.path.join(step_dir, "data", d) for d in os.listdir(os.path.join(step_dir, "data"))
                if d.split(".")[0] == str(rank))


def _phase_three(rank: int, world: int, base: str, frac: float) -> dict:
    """Node B lost (its directory deleted by the test), node A + a replaced node C."""
    _small_messages()
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
    if rank == 0:  # every chunk file of every local copy on the surviving node
        for b, _d, fs in os.walk(os.path.join(base, "A")):
            for f in fs:
                if f.startswith("c.") and os.path.getsize(os.path.join(b, f)):
                    _flip(os.path.join(b, f))
    torch.distributed.barrier()
    out["fallback"] = _restore(m, mesh)
    m.close()
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("tiers"))
    out = {"base": base}
    out["save"] = run_ranks(_phase_save, 4, base, timeout=300)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["ls", os.path.join(base, "root")])
    out["ls"] = buf.getvalue()
    shutil.rmtree(os.path.join(base, "B"))  # node B is lost
    frac = random.Random().uniform(0.0, 1.2)
    out["frac"] = frac
    try:
        run_ranks(_phase_three, 3, base, frac, timeout=300)
    except RankError as e:
        out["killed"] = str(e)
    out["two"] = run_ranks(_phase_two, 2, base, timeout=300)
    return out


def test_saves_local_steps_replicated_to_the_other_node(phases):
    r = phases["save"]
    assert all(x["local"] == [6, 8] and x["steps"] == [5] for x in r)
    # each node holds its own ranks' parts and the other node's: all four
    assert all(x["files"] == ["0.json", "1.json", "2.json", "3.json"] for x in r)
    assert [x["dirs"] for x in r] == [[".spare", "6", "8"]] * 4, [(x["dirs"], x["spares"], x["reused"]) for x in r]
    # each rank keeps its files of the step retention dropped (4: its own part's and the replica it
    # received), to write the next step into; step 8's came into step 2's; a closed manager leaves
    # no spares
    for rank, x in enumerate(r):
        src = (rank + 2) % 4
        mine = {tuple(f.split("/")[:2]) for f in x["spares"] if f.startswith(f"{rank}/")}
        assert mine == {(str(rank), str(rank)), (str(rank), str(src))}
        # its own write of step 8 wrote over the files of step 2 (dropped after step 6): the same inodes
        two, four, six, eight = x["inodes"]
        assert eight == two and len({i for _n, i in two + four + six}) == 3 * len(two) > 0
        assert x["reused"] > 0
        assert x["closed"] == ["6", "8"]
    assert all(x["restored"][:2] == (8, True) for x in r)
    assert not any(x["warnings"] for x in r)


def test_each_node_writes_a_merged_manifest_per_local_step(phases):
    """Once a step's replication finished, each node's first rank merged the four rank
    manifests it holds into the step's `xckpt.json`; a restore reads it."""
    assert all(x["merged"] == ["6", "8"] for x in phases["save"])


def _step_8_restored_warning(phases, case: str, *words: str) -> None:
    """Every rank restored step 8 bit for bit in `case`, and some rank warned with all of `words`."""
    r = [x[case] for x in phases["save"]]
    assert all(x[:2] == (8, True) for x in r)
    said = [w for x in r for w in x[2]]
    assert any(all(word in w for word in words) for w in said), said


def test_a_damaged_merged_manifest_falls_back_to_the_rank_manifests(phases):
    _step_8_restored_warning(phases, "merged_damaged", "rank 0's merged manifest is not used", "fails its checksum",
                             "the rank manifests are merged instead")


def test_an_invalid_rank_manifest_under_a_valid_checksum_is_passed_over(phases):
    _step_8_restored_warning(phases, "rank_manifest_invalid", "local step 8: rank 0's copy of rank 1's part is damaged",
                             "ManifestError", "bogus")


def test_merged_manifest_of_a_local_step_is_checked(tmp_path):
    """Written only from every rank manifest of the save, read only for that save, its
    checksum and layout checked."""
    from xckpt.errors import ManifestError
    from xckpt.manager._merged import MERGED, drop_merged, load_merged, read_merged, write_merged

    d = str(tmp_path / "s")
    xckpt.save({"a": np.arange(1000, dtype=np.float32)}, d)
    drop_merged(d)  # as a rank-local save leaves it
    drop_merged(d)  # none is no error
    assert read_merged(d) is None
    sid = xckpt.open(d).save_id
    assert not write_merged(d, sid, 2)  # rank 1's manifest is not there
    assert not write_merged(d, "other", 1)  # rank 0's manifest is another save's
    assert not os.path.exists(os.path.join(d, MERGED))
    assert write_merged(d, sid, 1)
    data = read_merged(d)
    assert data is not None and load_merged(data, d, sid, 1).save_id == sid
    assert sorted(os.listdir(d)) == ["data", "ranks", MERGED]  # no temporary file left
    with pytest.raises(ManifestError, match="expected the merged manifest of 'other' at world size 1"):
        load_merged(data, d, "other", 1)
    _flip_digit(os.path.join(d, MERGED))
    with pytest.raises(ManifestError, match="fails its checksum"):
        load_merged(read_merged(d) or b"", d, sid, 1)


def test_ls_says_where_local_steps_are(phases):
    text = phases["ls"]
    assert "local steps: every 2 steps on 2 nodes" in text
    assert os.path.join(phases["base"], "A") in text and os.path.join(phases["base"], "B") in text
    assert "latest 8" in text


def test_an_intact_replica_serves_beside_a_damaged_primary(phases):
    _step_8_restored_warning(phases, "damaged", "local step 8", "rank 0's part", "check")


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


# -- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "per_node", "replicas", "pairs"),
    [
        (4, 2, 1, [(0, 2), (1, 3), (2, 0), (3, 1)]),
        (3, 2, 1, [(0, 2), (1, 2), (2, 0)]),
        (6, 2, 2, [(0, 2), (0, 4), (1, 3), (1, 5), (2, 4), (2, 0), (3, 5), (3, 1), (4, 0), (4, 2), (5, 1), (5, 3)]),
        (4, 4, 1, []),
        (2, 1, 0, []),
    ],
)
def test_replicas_go_to_other_nodes(world, per_node, replicas, pairs):
    got = replica_pairs(world, per_node, replicas)
    assert got == pairs
    assert all(s // per_node != d // per_node for s, d in got)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.integers(0, 4))
def test_replica_pairs_property(world, per_node, replicas):
    """Every rank sends min(replicas, other nodes) copies, each to a rank of another node,
    no two to one node."""
    nodes = -(-world // per_node)
    got = replica_pairs(world, per_node, replicas)
    for r in range(world):
        dsts = [d for s, d in got if s == r]
        assert len(dsts) == min(replicas, nodes - 1)
        assert all(0 <= d < world and d // per_node != r // per_node for d in dsts)
        assert len({d // per_node for d in dsts}) == len(dsts)


def _hooked():
    """A device-copy hook that copies when the writer waits on its event (as a CUDA copy on a
    side stream lands later), counting calls."""
    calls = []

    def hook(host, src):
        snapshot = src.detach().clone()
        calls.append(tuple(src.shape))

        class Event:
            def synchronize(self):
                host.copy_(snapshot)

        return Event()

    return hook, calls


def test_one_process_local_steps_through_the_copy_hook(tmp_path):
    """One process, torch state: local steps staged through the device-copy hook (the GPU
    path's logic), kept by local_keep, restored bit for bit from the local tier; one node
    warns once that nothing is replicated."""
    hook, calls = _hooked()
    local = str(tmp_path / "shm")
    with pytest.warns(RuntimeWarning, match="not replicated: all 1 ranks are on one node"):
        m = CheckpointManager(str(tmp_path / "root"), local=local, local_every=2, save_every=4,
                              handle_preemption=False)
    m.staging.device_copy = hook
    sd = {"w": torch.zeros(64, 8), "h": torch.zeros(5, dtype=torch.bfloat16), "n": 0}
    for step in range(1, 8):
        sd["w"].fill_(step)
        sd["h"].fill_(step / 3)
        sd["n"] = step
        m.save(step, sd)
        sd["w"].add_(1000)  # the caller goes on at once: what was staged stays
    m.wait()
    # step 2's files kept as spares, for the next local step to write over
    assert m.local_steps() == [4, 6] and m.steps() == [4] and sorted(os.listdir(local)) == [".spare", "4", "6"]
    assert len(calls) == 2 * (3 + 1)  # local steps 2, 4, 6 and persistent step 4
    target = {"w": torch.empty(64, 8), "h": torch.empty(5, dtype=torch.bfloat16), "n": None}
    m.restore(target)
    assert target["n"] == 6 and torch.equal(target["w"], torch.full((64, 8), 6.0))
    assert torch.equal(target["h"].view(torch.int16), torch.full((5,), 2.0, dtype=torch.bfloat16).view(torch.int16))
    m.restore(target, step=4)
    assert target["n"] == 4
    m.close()
    assert sorted(os.listdir(local)) == ["4", "6"]  # no spares once closed
    assert CheckpointManager(str(tmp_path / "root"), local=local, replicas=0).local_steps() == [4, 6]


def test_one_process_numpy_and_fallback_to_persistent(tmp_path):
    local = str(tmp_path / "shm")
    m = CheckpointManager(str(tmp_path / "root"), local=local, local_every=1, save_every=3, replicas=0,
                          handle_preemption=False)
    state = {"a": np.zeros(1000, np.float32), "k": 0}
    for step in range(1, 6):
        state["a"][:] = step
        state["k"] = step
        m.save(step, state)
    m.wait()
    assert m.restore()["k"] == 5
    for b, _d, fs in os.walk(local):
        for f in fs:
            if f.startswith("c."):
                _flip(os.path.join(b, f))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = m.restore()
    assert got["k"] == 3 and float(got["a"][0]) == 3.0  # the persistent step: no local copy is intact
    said = [str(w.message) for w in caught]
    assert any("local step 5: rank 0's copy of rank 0's part fails its check" in w for w in said), said
    assert any("local step 5 is passed over" in w for w in said), said
    with pytest.raises(XckptError, match=r"no complete copy of step 2 under .* persistent step numbers: \[3\]"):
        m.restore(step=2)
    m.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local": "memory://shm"}, "is not a node-local directory"),
        ({"local": "L", "replicas": -1}, "replicas must be an integer >= 0"),
        ({"local": "L", "local_every": 0}, "local_every"),
        ({"local": "L", "ranks_per_node": 0}, "ranks_per_node must be an integer >= 1"),
        ({"local": "R"}, "is the manager's root: local steps and persistent steps would share step directories"),
    ],
)
def test_bad_tier_arguments(tmp_path, kwargs, match):
    if kwargs["local"] == "L":
        kwargs = {**kwargs, "local": str(tmp_path / "shm")}
    if kwargs["local"] == "R":
        kwargs = {**kwargs, "local": str(tmp_path / "root") + "/"}
    with pytest.raises(XckptError, match=match):
        CheckpointManager(str(tmp_path / "root"), handle_preemption=False, **kwargs)


def test_ls_on_a_root_with_local_steps_only(tmp_path, capsys):
    root = str(tmp_path / "root")
    with CheckpointManager(root, local=str(tmp_path / "shm"), local_every=1, save_every=100, replicas=0,
                           handle_preemption=False) as m:
        m.save(1, {"a": np.ones(3)})
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "0 complete steps" in out and "local steps: every 1 steps on 1 nodes" in out and "latest 1" in out


def test_nothing_anywhere_is_an_error(tmp_path):
    m = CheckpointManager(str(tmp_path / "root"), local=str(tmp_path / "shm"), replicas=0, handle_preemption=False)
    with pytest.raises(XckptError, match="no complete copy of any step .* nothing to restore"):
        m.restore()


def test_a_replica_damaged_in_transit_is_refused(tmp_path):
    """A replica is the writer's files under the same names, with the writer's checksums: a
    damaged manifest is refused on arrival (no copy counts), damaged data by every restore."""
    from xckpt.manager._replicate import pack, unpack

    want = np.arange(300000, dtype=np.float32)
    xckpt.save({"a": want}, str(tmp_path / "s"))
    os.rename(tmp_path / "s" / "xckpt.json", tmp_path / "merged.json")  # as a rank-local save leaves it
    buf = pack(str(tmp_path / "s"), 0)
    unpack(buf.copy(), str(tmp_path / "good"), 0)
    assert xckpt.load(str(tmp_path / "good"))["a"].tobytes() == want.tobytes()
    bad = buf.copy()
    bad[-40] ^= 1  # in the manifest (last)
    with pytest.raises(XckptError, match="its manifest is damaged .*; the copy was dropped"):
        unpack(bad, str(tmp_path / "bad"), 0)
    assert not os.path.exists(tmp_path / "bad" / "ranks" / "0.json")
    bad = buf.copy()
    bad[len(buf) // 2] ^= 1  # in the data
    unpack(bad, str(tmp_path / "flipped"), 0)
    with pytest.raises(CorruptChunkError, match="fails its crc32c check"):
        xckpt.load(str(tmp_path / "flipped"))


@pytest.mark.gpu
def test_cuda_local_steps_pinned_and_restored_onto_the_device(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    sd = {"w": torch.randn(1024, 512, device=dev), "b": torch.randn(77, device=dev).to(torch.bfloat16)}
    m = CheckpointManager(str(tmp_path / "root"), local=str(tmp_path / "shm"), local_every=1, save_every=100,
                          replicas=0, handle_preemption=False)
    m.save(1, sd)
    want = {k: v.cpu().clone() for k, v in sd.items()}
    sd["w"].mul_(2)  # queued right after save returns: runs after the staging copy
    m.wait()
    target = {"w": torch.empty(1024, 512, device=dev), "b": torch.empty(77, device=dev, dtype=torch.bfloat16)}
    m.restore(target)
    assert torch.equal(target["w"].cpu(), want["w"])
    assert torch.equal(target["b"].cpu().view(torch.int16), want["b"].view(torch.int16))
    m.close()


def test_ranks_of_a_node_deleting_one_local_step_at_once_never_fail(tmp_path):
    """Every rank of a node prunes the same old local step at the same time (the full suite
    once caught rank 3's delete failing on a file rank 2 had just removed)."""
    import threading

    from xckpt.manager._tiers import _rmtree

    for trial in range(20):
        step = tmp_path / str(trial)
        for sub in ("ranks", "data/0/t/a", "data/1/t/b", "data/2/packed"):
            (step / sub).mkdir(parents=True)
            for i in range(20):
                (step / sub / f"f{i}").write_bytes(b"x")
        errors: list[BaseException] = []

        def delete(path=str(step), errors=errors):
            try:
                _rmtree(path)
            except BaseException as e:  # recorded for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=delete) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and not step.exists()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.lists(st.tuples(st.integers(0, 45), st.integers(1, 12)), max_size=6),
       st.booleans())
def test_row_range_layout_check_agrees_with_the_general_one(rows, cols, boxes, tiled):
    """`rows_tile` (the fast layout check of `xckpt.native.commit.validate`) accepts only what the general
    check accepts, and accepts every row split."""
    from xckpt.layout import check_coverage
    from xckpt.manifest import Chunk
    from xckpt.native.commit import rows_tile

    shape = (rows, cols)
    if tiled:  # cut points from the drawn offsets: a true row split
        cuts = sorted({0, rows} | {o % rows for o, _n in boxes})
        boxes = [(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
    chunks = [Chunk(offset=(o, 0), shape=(n, cols), key="k", rank=0, nbytes=0) for o, n in boxes]
    try:
        check_coverage(shape, [c.box for c in chunks], name="t", where="w")
        tiles = True
    except XckptError:
        tiles = False
    assert not rows_tile(shape, chunks) or tiles
    if tiled:
        assert rows_tile(shape, chunks) and tiles
