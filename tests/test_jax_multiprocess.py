"""Multi-process JAX: two processes (jax.distributed on 127.0.0.1, 4 CPU devices
each) save one global array and load it back in another sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from dist_utils import free_port

import xckpt
from xckpt.layout import choose_writer

WORKER = textwrap.dedent(
    """
    import json, sys
    pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xckpt.jax as xj

    if (jax.device_count(), jax.local_device_count()) != (8, 4):
        raise SystemExit(f"expected 8 devices, 4 local; got {jax.device_count()}, {jax.local_device_count()}")
    full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    rep = np.arange(8, dtype=np.int32) * 3
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("a", "b")), lambda i: full[i])
    # Replicated over "a": each box is held by devices of both processes.
    r = jax.make_array_from_callback(rep.shape, NamedSharding(mesh, P("b")), lambda i: rep[i])
    xj.save({"w": w, "r": r, "step": 5}, path)
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    out = xj.load(path, {"w": NamedSharding(mesh2, P(("b", "a"), None)), "r": NamedSharding(mesh2, P()),
                         "step": 0})
    checked = 0
    for sh in out["w"].addressable_shards:
        if not np.array_equal(np.asarray(sh.data), full[sh.index]):
            raise SystemExit(f"process {pid}: w shard {sh.index} differs")
        checked += 1
    for sh in out["r"].addressable_shards:
        if not np.array_equal(np.asarray(sh.data), rep):
            raise SystemExit(f"process {pid}: r differs")
    holders = {}
    for dev, idx in NamedSharding(mesh, P("b")).devices_indices_map(rep.shape).items():
        holders.setdefault(idx[0].start or 0, set()).add(dev.process_index)
    print(json.dumps({"pid": pid, "checked": checked, "step": out["step"],
                      "r_holders": {str(k): sorted(v) for k, v in holders.items()}}))
    jax.distributed.shutdown()
    """
)


def test_two_processes_save_and_load(tmp_path: pytest.TempPathFactory) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    path = str(tmp_path / "ck")
    port = str(free_port())
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(i), port, path], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} failed (rc {rc}):\n{out}\n{err[-4000:]}"
    results = [json.loads(o.strip().splitlines()[-1]) for _, o, _ in outs]
    assert [r["checked"] for r in results] == [4, 4] and [r["step"] for r in results] == [5, 5]

    ck = xckpt.open(path)
    assert ck.world_size == 2
    assert ck.storage.read_key("xckpt.json") is not None  # finalized by process 0
    full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    host = xckpt.load(path)
    assert np.array_equal(host["w"], full) and np.array_equal(host["r"], np.arange(8, dtype=np.int32) * 3)
    assert host["step"] == 5
    # Each process wrote only its own shards of w: both ranks appear, 8 boxes in all.
    w_chunks = ck.info("w").chunks
    assert len(w_chunks) == 8 and {c.rank for c in w_chunks} == {0, 1}
    # Replicated boxes of r: one writer each, the one choose_writer picks among the holders.
    holders = results[0]["r_holders"]
    boxes = sorted(int(k) for k in holders)
    assert all(holders[str(b)] == [0, 1] for b in boxes)
    want = {b: choose_writer("r", i, [0, 1]) for i, b in enumerate(boxes)}
    got = {c.offset[0]: c.rank for c in ck.info("r").chunks}
    assert got == want
