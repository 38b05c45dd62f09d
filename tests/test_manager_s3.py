"""xckpt.CheckpointManager on a real S3-compatible server (moto, tests/s3_server.py): steps
listed and deleted through tensorstore's kvstore, retention, an incomplete step removed,
2 gloo ranks saving DTensors and 3 restoring them in another placement, and JAX."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import s3_server
from dist_utils import run_ranks

import xckpt
from xckpt.errors import CheckpointNotFoundError
from xckpt.manager import CheckpointManager, manager_steps
from xckpt.native.steps import step_location


@pytest.fixture(scope="module")
def s3():
    yield from s3_server.serve()


def _state(v: float) -> dict:
    return {"w": np.full((300, 40), v, np.float32), "small": np.arange(5) + int(v), "step": int(v)}


def test_steps_retention_restore_on_s3(s3):
    root = s3.fresh("mgr")
    with CheckpointManager(root, keep_last=2, keep_best=1, metric="loss", handle_preemption=False) as m:
        for s, loss in [(1, 0.1), (2, 0.5), (3, 0.4), (4, 0.3)]:
            assert m.save(s, _state(s), metrics={"loss": loss})
        m.wait()
        assert m.steps() == [1, 3, 4] and m.best_step() == 1
        assert s3.keys(step_location(root, 2)) == []  # every object of the deleted step is gone
        assert any(k.endswith("4/xckpt.json") for k in s3.keys(root))
        got = m.restore()
        assert got["step"] == 4 and float(got["w"][0, 0]) == 4.0
    m2 = CheckpointManager(root, metric="loss", handle_preemption=False)
    assert m2.steps() == [1, 3, 4] and m2.metrics(3) == {"loss": 0.4} and m2.restore(step=1)["step"] == 1
    m2.close()


def test_an_incomplete_step_on_s3_is_removed_by_the_next_save(s3):
    root = s3.fresh("mgr")
    with CheckpointManager(root, handle_preemption=False) as m:
        m.save(1, _state(1))
    w = xckpt.Writer(step_location(root, 2), save_id="killed")  # a save killed after its claim and data
    w.write("w", np.ones((64, 64), np.float32))
    w._flush()
    assert [(i.step, i.complete) for i in manager_steps(root)] == [(1, True), (2, False)]
    with CheckpointManager(root, handle_preemption=False) as m:
        assert m.steps() == [1]
        m.save(3, _state(3))
    assert [i.step for i in manager_steps(root)] == [1, 3] and s3.keys(step_location(root, 2)) == []


def test_jax_on_s3(s3):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    root = s3.fresh("mgr-jax")
    mesh = jax.make_mesh((8,), ("x",))
    w = jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), NamedSharding(mesh, P("x")))
    with CheckpointManager(root, keep_last=1, handle_preemption=False) as m:
        m.save(1, {"w": w})
        m.save(2, {"w": w + 1})
        mesh2 = jax.make_mesh((4, 2), ("a", "b"))
        got = m.restore({"w": NamedSharding(mesh2, P("b", "a"))})
        assert m.steps() == [2]
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w) + 1)


def _torch_save(rank: int, world: int, root: dict) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(30 * 6, dtype=torch.float32).reshape(30, 6)
    sd = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "b": torch.ones(4), "step": 0}
    with CheckpointManager(root, keep_last=1, handle_preemption=False) as m:
        for step in (1, 2):
            sd["step"] = step
            m.save(step, sd)
            sd["w"].add_(1.0)  # in place, right after save returns


def _torch_restore(rank: int, world: int, root: dict) -> tuple:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target = {"w": distribute_tensor(torch.zeros(30, 6), mesh, [Shard(1)]), "b": torch.zeros(4), "step": None}
    m = CheckpointManager(root, handle_preemption=False)
    m.restore(target)
    return m.steps(), target["step"], target["w"].full_tensor().numpy(), target["b"].numpy()


@pytest.mark.slow
def test_torch_two_ranks_save_three_restore_on_s3(s3):
    root = s3.fresh("mgr-torch")
    run_ranks(_torch_save, 2, root, timeout=120)
    for steps, step, w, b in run_ranks(_torch_restore, 3, root, timeout=120):
        assert steps == [2] and step == 2
        np.testing.assert_array_equal(w, np.arange(180, dtype=np.float32).reshape(30, 6) + 1)
        np.testing.assert_array_equal(b, np.ones(4, np.float32))


LEAD_EDITS = "step" in inspect.signature(xckpt.open).parameters


@pytest.mark.skipif(not LEAD_EDITS, reason="needs the lead's formats.py edit of issue 23")
def test_open_a_manager_root_on_s3(s3):
    root = s3.fresh("mgr-open")
    with CheckpointManager(root, handle_preemption=False) as m:
        m.save(5, _state(5))
        m.save(9, _state(9))
    with pytest.raises(CheckpointNotFoundError, match=r"manager root.*complete steps \[5, 9\]"):
        xckpt.open(root)
    with xckpt.open(root, step="latest") as ck:
        assert ck.read("w")[0, 0] == 9.0
