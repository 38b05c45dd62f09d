"""The three save verbs line up: data first, the same options, a Future from every async save.

``xckpt.save`` and ``xckpt.jax.save`` (one process and two real ``jax.distributed``
processes) are saved asynchronously here; ``xckpt.torch.save``'s async save runs on
real gloo ranks in test_torch_modes.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from dist_utils import free_port

import xckpt
from xckpt.errors import CheckpointExistsError, XckptError
from xckpt.manifest import Manifest

SHARED = {"overwrite": False, "save_id": None, "show_progress": None, "async_save": False}


def _verbs() -> dict:
    import xckpt.jax
    import xckpt.torch

    return {"xckpt": xckpt.save, "torch": xckpt.torch.save, "jax": xckpt.jax.save}


@pytest.mark.parametrize("verb", ["xckpt", "torch", "jax"])
def test_data_first_and_the_same_options(verb: str) -> None:
    params = inspect.signature(_verbs()[verb]).parameters
    names = list(params)
    assert names[1] == "path" and names[0] in ("mapping", "state_dict", "tree")
    for opt, default in SHARED.items():
        assert params[opt].kind is inspect.Parameter.KEYWORD_ONLY, opt
        assert params[opt].default is default, opt


def test_core_save_in_the_old_order_says_so(tmp_path: os.PathLike) -> None:
    with pytest.raises(XckptError, match=r"data first and the location second: xckpt\.save\(mapping, path\)"):
        xckpt.save(str(tmp_path / "c"), {"a": np.zeros(3)})  # type: ignore[arg-type]
    assert not os.path.exists(tmp_path / "c")


def test_core_sync_save_returns_the_manifest(tmp_path: os.PathLike) -> None:
    m = xckpt.save({"a": np.arange(6.0), "step": 3}, tmp_path / "c", save_id="s7")
    assert isinstance(m, Manifest) and m.save_id == "s7" and list(m.tensors) == ["a"]
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        xckpt.save({"a": np.arange(6.0)}, tmp_path / "c")


def test_core_async_save_keeps_the_values_at_the_call(tmp_path: os.PathLike) -> None:
    a = np.arange(300_000, dtype=np.float32)  # large enough for its own chunk array
    small = np.arange(5, dtype=np.int64)
    fut = xckpt.save({"a": a, "small": small, "note": {"k": [1, 2]}}, tmp_path / "c", async_save=True)
    assert isinstance(fut, cf.Future)
    a += 1000.0  # the caller changes its arrays at once
    small[:] = -1
    m = fut.result(timeout=60)
    assert isinstance(m, Manifest) and sorted(m.tensors) == ["a", "small"]
    got = xckpt.load(str(tmp_path / "c"))
    assert np.array_equal(got["a"], np.arange(300_000, dtype=np.float32))
    assert np.array_equal(got["small"], np.arange(5)) and got["note"] == {"k": [1, 2]}


def test_core_async_save_errors_at_the_call_and_in_the_future(tmp_path: os.PathLike) -> None:
    xckpt.save({"a": np.zeros(2)}, tmp_path / "c")
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):  # the location is checked before
        xckpt.save({"a": np.ones(2)}, tmp_path / "c", async_save=True)
    fut = xckpt.save({"a": np.ones(2)}, tmp_path / "c", async_save=True, overwrite=True)
    second = xckpt.save({"b": np.ones(1)}, tmp_path / "d")  # waits for the first
    assert fut.done() and list(second.tensors) == ["b"]
    assert np.array_equal(xckpt.load(str(tmp_path / "c"))["a"], np.ones(2))


def test_jax_async_save_is_complete_when_the_future_resolves(tmp_path: os.PathLike) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    full = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("a", "b")), lambda i: full[i])
    host = np.arange(4, dtype=np.int32)
    fut = xj.save({"w": w, "h": host, "step": 9}, tmp_path / "c", async_save=True, save_id="j1")
    assert isinstance(fut, cf.Future)
    host[:] = 7  # after the call: not in the checkpoint
    del w
    m = fut.result(timeout=60)
    assert isinstance(m, Manifest) and m.save_id == "j1" and sorted(m.tensors) == ["h", "w"]
    got = xckpt.load(str(tmp_path / "c"))
    assert np.array_equal(got["w"], full) and np.array_equal(got["h"], np.arange(4, dtype=np.int32))
    assert got["step"] == 9


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

    full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("a", "b")), lambda i: full[i])
    futs = [xj.save({"w": w, "step": k}, f"{path}/{k}", async_save=True) for k in range(2)]
    ms = [f.result(timeout=120) for f in futs]
    print(json.dumps({"pid": pid, "ranks": [m.rank for m in ms], "worlds": [m.world_size for m in ms]}))
    jax.distributed.shutdown()
    """
)


def test_jax_async_save_two_processes(tmp_path: os.PathLike) -> None:
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
    assert [r["ranks"] for r in results] == [[0, 0], [1, 1]] and all(r["worlds"] == [2, 2] for r in results)
    full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    for k in range(2):
        ck = xckpt.open(f"{path}/{k}")
        assert ck.world_size == 2 and ck.storage.read_key("xckpt.json") is not None  # finalized
        got = xckpt.load(f"{path}/{k}")
        assert np.array_equal(got["w"], full) and got["step"] == k
