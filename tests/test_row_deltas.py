"""Row deltas in a manager root (format version 6, DESIGN.md section 12).

A 2-D tensor of which few rows changed since the previous step is stored as a patch of
those rows over a base; every loader reads delta steps bit for bit (numpy by box, torch
in one process and on 2 gloo ranks as row- and column-sharded DTensors, JAX sharded over
8 devices, convert); chains stay shorter than full_every; the choice of tensors, damage
and bad arguments.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from dist_utils import run_ranks

import xckpt
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.native.steps import step_location

ROWS, COLS = 3000, 48


def _mgr(root, **kw) -> xckpt.CheckpointManager:
    kw.setdefault("handle_preemption", False)
    return xckpt.CheckpointManager(str(root), **kw)


def _run(root, steps=5, changed=40, **kw) -> list[dict[str, np.ndarray]]:
    """Saves of a float32 table and a bf16 one (NaN payloads included), ``changed`` rows
    each per step; the states saved, by step."""
    rng = np.random.default_rng(3)
    tab = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    emb = (rng.standard_normal((ROWS, 64)) * 0.02).astype(ml_dtypes.bfloat16)
    emb.view(np.uint16)[5, :3] = [0x7FC1, 0xFFC3, 0x7F81]  # NaNs of several payloads
    hist = []
    with _mgr(root, **kw) as m:
        for s in range(steps):
            if s:
                tab[rng.choice(ROWS, changed, replace=False)] += 1
                emb[rng.choice(ROWS, changed, replace=False)] = np.array(s, ml_dtypes.bfloat16)
            m.save(s, {"tab": tab, "emb": emb, "step": s})
            hist.append({"tab": tab.copy(), "emb": emb.copy()})
    return hist


def _chains(root, step) -> dict[str, int]:
    doc = json.loads((root / str(step) / "xckpt.json").read_bytes())
    names = {c["key"]: n for n, t in doc["tensors"].items() if isinstance(t, dict) for c in t.get("chunks", [])}
    return {names[k]: len(v) for k, v in doc.get("deltas", {}).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("deltas") / "r"
    return root, _run(root, steps=5, full_every=3)


def test_delta_steps_read_bit_exact(saved):
    root, hist = saved
    assert [_chains(root, s) for s in range(5)] == [{}, {"tab": 1, "emb": 1}, {"tab": 2, "emb": 2}, {},
                                                     {"tab": 1, "emb": 1}]
    full = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "0") for f in fs)
    delta = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "2") for f in fs)
    assert delta < full / 20
    for s, want in enumerate(hist):
        with xckpt.open(root / str(s)) as ck:
            for n, v in want.items():
                assert ck.read(n).tobytes() == v.tobytes(), (s, n)
                assert ck.read(n, (slice(1000, 2100), slice(3, 11))).tobytes() == v[1000:2100, 3:11].tobytes()
            assert ck.verify() == []


def test_delta_steps_by_torch_jax_and_convert(saved, tmp_path):
    import jax
    import torch
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj
    import xckpt.torch as xt

    root, hist = saved
    loc = step_location(str(root), 2)
    out = {"tab": torch.empty(ROWS, COLS), "emb": torch.empty(ROWS, 64, dtype=torch.bfloat16)}
    xt.load(loc, out)
    assert out["tab"].numpy().tobytes() == hist[2]["tab"].tobytes()
    assert out["emb"].view(torch.int16).numpy().tobytes() == hist[2]["emb"].tobytes()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    target = {"tab": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=NamedSharding(mesh, P("x", "y")))}
    got = xj.load(loc, target)
    assert np.asarray(got["tab"]).tobytes() == hist[2]["tab"].tobytes()
    xckpt.convert(loc, str(tmp_path / "t.safetensors"))
    with xckpt.open(tmp_path / "t.safetensors") as ck:
        assert ck.read("emb").tobytes() == hist[2]["emb"].tobytes()


def _dtensor_body(rank: int, world: int, loc: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dim in (0, 1):
        t = {"tab": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)]),
             "emb": distribute_tensor(torch.zeros(ROWS, 64, dtype=torch.bfloat16), mesh, [Shard(dim)])}
        xt.load(loc, t)
        out[dim] = {"tab": t["tab"].full_tensor().numpy().tobytes(),
                    "emb": t["emb"].full_tensor().view(torch.int16).numpy().tobytes()}
    return out


def test_delta_step_by_two_torch_ranks(saved):
    root, hist = saved
    for r in run_ranks(_dtensor_body, 2, step_location(str(root), 4), timeout=180):
        for dim in (0, 1):
            assert r[dim]["tab"] == hist[4]["tab"].tobytes() and r[dim]["emb"] == hist[4]["emb"].tobytes()


def test_which_tensors_and_when(tmp_path):
    _run(tmp_path / "named", steps=2, row_deltas=["emb"])
    assert _chains(tmp_path / "named", 1) == {"emb": 1}
    _run(tmp_path / "off", steps=2, row_deltas=False)
    assert _chains(tmp_path / "off", 1) == {}
    _run(tmp_path / "half", steps=2, changed=ROWS // 2)  # half the rows: saved whole
    assert _chains(tmp_path / "half", 1) == {}
    _run(tmp_path / "sync", steps=2, async_save=False)  # no staged copy to compare with
    assert _chains(tmp_path / "sync", 1) == {}
    with pytest.raises(XckptError, match="row_deltas='emb'"):
        _mgr(tmp_path / "bad", row_deltas="emb")
    with pytest.raises(XckptError, match="full_every=0"):
        _mgr(tmp_path / "bad", full_every=0)


def test_damaged_patch(tmp_path):
    root = tmp_path / "r"
    hist = _run(root, steps=2)
    doc = json.loads((root / "1" / "xckpt.json").read_bytes())
    patch = next(iter(doc["deltas"].values()))[0]
    shard = root / "1" / f"{patch['key']}-rows" / "c.0.0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with xckpt.open(root / "1") as ck:
        (problem,) = ck.verify()
        assert "row patch" in problem
        with pytest.raises(CorruptChunkError, match="row patch"):
            ck.read_all()
    assert len(hist) == 2
