"""xckpt.CheckpointManager with JAX: pytrees on 8 simulated CPU devices restored onto another
mesh and sharding, staging buffers reused, donation right after save, and two JAX processes
(jax.distributed on 127.0.0.1) agreeing on a SIGTERM one of them got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from dist_utils import free_port
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xckpt.manager import CheckpointManager


class AdamState(NamedTuple):  # an optax-like state: a tuple node of the pytree
    mu: jax.Array
    count: jax.Array


def _tree(mesh, v: float) -> dict:
    x = NamedSharding(mesh, P("x"))
    rep = NamedSharding(mesh, P())
    w = np.arange(64 * 24, dtype=np.float32).reshape(64, 24) + v
    return {
        "params": {"w": jax.device_put(w, x), "b": jax.device_put(np.full(24, v, np.float32), rep),
                   "e": jax.device_put(np.ones((16, 8), ml_dtypes.bfloat16) * v, x)},
        "opt": AdamState(mu=jax.device_put(w * 0.5, x), count=jax.device_put(np.int32(v), rep)),
        "layers": [jax.device_put(np.full((8,), v + i, np.float32), x) for i in range(2)],
        "step": int(v),
    }


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), ("x",))


def test_save_and_restore_onto_another_sharding(tmp_path, mesh):
    with CheckpointManager(str(tmp_path), keep_last=2, handle_preemption=False) as m:
        for s in range(4):
            assert m.save(s, _tree(mesh, float(s)), metrics={"loss": 4.0 - s})
        m.wait()
        assert m.steps() == [2, 3]
        mesh2 = jax.make_mesh((2, 4), ("a", "b"))
        saved = _tree(mesh, 3.0)
        shard = {"w": P("b", "a"), "b": P("b"), "e": P(None, "a")}
        target = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh2, P()))
            if isinstance(a, jax.Array) else a, saved)
        target["params"] = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, shard[k]))
                            for k, v in saved["params"].items()}
        target["step"] = 0
        got = m.restore(target)
    assert got["step"] == 3 and isinstance(got["opt"], AdamState)
    for k in ("w", "b", "e"):
        assert got["params"][k].sharding == NamedSharding(mesh2, shard[k])
        np.testing.assert_array_equal(np.asarray(got["params"][k]), np.asarray(saved["params"][k]))
    np.testing.assert_array_equal(np.asarray(got["opt"].mu), np.asarray(saved["opt"].mu))
    assert int(got["opt"].count) == 3 and float(got["layers"][1][0]) == 4.0


def test_buffers_reused_and_donation_after_save(tmp_path, mesh):
    @jax.jit
    def _update(tree):
        return jax.tree_util.tree_map(lambda a: a + 1, tree)

    update = jax.jit(_update, donate_argnums=0)
    state = {"w": jax.device_put(np.zeros((256, 64), np.float32), NamedSharding(mesh, P("x")))}
    with CheckpointManager(str(tmp_path), handle_preemption=False) as m:
        for s in range(4):
            m.save(s, state)
            state = update(state)  # donates the buffers save just read from
            if s == 0:
                first = m.staging.allocations
        m.wait()
        assert first == 8 and m.staging.allocations == first  # one buffer per device box, reused
        assert m.staging.nbytes == 256 * 64 * 4
        for s in range(4):
            assert float(m.restore(step=s)["w"][0, 0]) == s


def test_restore_with_shardings_alone_and_numpy(tmp_path, mesh):
    with CheckpointManager(str(tmp_path), handle_preemption=False) as m:
        m.save(7, {"a": jax.device_put(jnp.arange(32.0), NamedSharding(mesh, P("x"))), "n": 2})
        got = m.restore({"a": NamedSharding(mesh, P()), "n": 0})
        assert got["a"].sharding.is_fully_replicated and float(got["a"][31]) == 31.0 and got["n"] == 2
        flat = m.restore()
        assert isinstance(flat["a"], np.ndarray) and flat["n"] == 2


WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from xckpt.manager import CheckpointManager

    mesh = jax.make_mesh((8,), ("x",))
    full = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    m = CheckpointManager(root, save_every=2, keep_last=1)
    step = 0
    try:
        for step in range(1, 50):
            w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda i: full[i] + step)
            if step == 5 and pid == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if m.should_save(step):
                m.save(step, {"w": w, "step": step})
            time.sleep(0.01)
    except SystemExit as e:
        print(json.dumps({"pid": pid, "code": e.code, "step": step}), flush=True)
        os._exit(0)
    print(json.dumps({"pid": pid, "code": None, "step": step}), flush=True)
    """
)


def test_two_jax_processes_agree_on_a_sigterm(tmp_path):
    port = free_port()
    root = str(tmp_path / "root")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), root], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=lambda d: d["pid"])
    assert [(g["code"], g["step"]) for g in got] == [(143, 5), (143, 5)]
    m = CheckpointManager(root, handle_preemption=False)
    assert m.steps() == [5]  # keep_last=1: 2 and 4 deleted; 5 saved on preemption
    mesh2 = jax.make_mesh((2, 4), ("a", "b"))
    out = m.restore({"w": NamedSharding(mesh2, P("b", "a")), "step": 0})
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64, dtype=np.float32).reshape(16, 4) + 5)
    assert out["step"] == 5
