"""xckpt.jax.orbax: a real orbax CheckpointManager item saved as xckpt (async, the manager's
default, and sync) and restored into another sharding; the step directory is an ordinary
xckpt checkpoint that xckpt.open and xckpt.torch read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import xckpt
from xckpt.jax.orbax import XckptHandler, XckptRestore, XckptSave


def _state() -> dict:
    devs = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = Mesh(devs, ("a", "b"))
    w = jnp.arange(48 * 24, dtype=jnp.float32).reshape(48, 24)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),
            "b": jax.device_put(jnp.linspace(0, 1, 24).astype(jnp.bfloat16), NamedSharding(mesh, P())),
        },
        "step": 7,
    }


@pytest.mark.parametrize("async_save", [True, False])
def test_manager_item_saved_as_xckpt_restored_into_another_sharding(tmp_path, async_save):
    state = _state()
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=async_save)
    with ocp.CheckpointManager(tmp_path, options=opts, item_names=("state", "meta")) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, args=ocp.args.Composite(state=XckptSave(state), meta=ocp.args.JsonSave({"s": step})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]

        mesh2 = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("x", "y"))
        target = {
            "params": {
                "w": jax.ShapeDtypeStruct((48, 24), jnp.float32, sharding=NamedSharding(mesh2, P("y", "x"))),
                "b": NamedSharding(mesh2, P("y")),
            },
            "step": 0,  # a placeholder leaf (None is an empty subtree to JAX)
        }
        back = mngr.restore(3, args=ocp.args.Composite(state=XckptRestore(target), meta=ocp.args.JsonRestore()))
    got = back.state
    assert got["params"]["w"].sharding == NamedSharding(mesh2, P("y", "x")) and got["step"] == 7
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.asarray(state["params"]["w"]))
    assert got["params"]["b"].dtype == jnp.bfloat16
    assert np.asarray(got["params"]["b"]).tobytes() == np.asarray(state["params"]["b"]).tobytes()
    assert back.meta == {"s": 3}
    with xckpt.open(tmp_path / "3" / "state") as ck:  # an ordinary xckpt checkpoint
        assert sorted(ck.names()) == ["params.b", "params.w"] and ck.verify() == []


def test_metadata_and_restore_without_target(tmp_path):
    state = _state()
    handler = XckptHandler()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "c", args=XckptSave(state))
        meta = handler.metadata(tmp_path / "c")
        flat = ckptr.restore(tmp_path / "c", args=XckptRestore())
    assert meta["params.w"] == jax.ShapeDtypeStruct((48, 24), jnp.float32) and meta["step"] == 7
    assert meta["params.b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(flat["params.w"], np.asarray(state["params"]["w"]))
